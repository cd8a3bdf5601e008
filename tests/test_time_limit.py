"""Every test has a time limit (pytest-timeout, configured in pyproject.toml): a regression that hangs fails
the suite in minutes instead of holding CI until its own limit."""

import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_runs_under_the_projects_limit(request):
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert float(request.config.getini("timeout")) == options["timeout"] > 0
    assert request.config.getini("timeout_method") == options["timeout_method"] == "thread"


def test_a_hanging_test_fails_at_the_limit(pytester):
    """A test stuck in a wait fails at the limit, its stack in the output, under the project's method."""
    pytester.makepyfile(
        test_hang="import threading\n\ndef test_waits_forever():\n    threading.Event().wait()\n"
    )
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "timeout", "-o", "timeout=2", "-o", "timeout_method=thread")
    assert time.monotonic() - started < 60
    assert result.ret != 0
    output = result.stdout.str() + result.stderr.str()
    assert "Timeout" in output and "test_waits_forever" in output
