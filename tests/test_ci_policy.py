"""A test that skips fails the suite in CI, and only there, except for the one reason the CPU decides."""

SKIPPING = """
import pytest

def test_needs_a_component():
    pytest.skip("needs Slurm: run `make slurm`")

def test_runs():
    pass
"""


def test_a_skip_fails_in_ci_and_only_skips_elsewhere(pytester, monkeypatch):
    pytester.makeconftest('pytest_plugins = ["tests.ci_policy"]')
    pytester.makepyfile(SKIPPING)
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest_inprocess("-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*skipped in CI, where every test must run: needs Slurm: run `make slurm`*"])
    monkeypatch.delenv("CI")
    pytester.runpytest_inprocess("-q").assert_outcomes(passed=1, skipped=1)


def test_the_one_skip_ci_accepts_is_a_cpu_without_amx(pytester, monkeypatch):
    from tests.ci_policy import NEEDS_AMX

    pytester.makeconftest('pytest_plugins = ["tests.ci_policy"]')
    pytester.makepyfile(
        f"""
import pytest

def test_of_the_amx_path():
    pytest.skip({NEEDS_AMX!r})

def test_needs_amx_and_something_else():
    pytest.skip({NEEDS_AMX + " and Slurm"!r})
"""
    )
    monkeypatch.setenv("CI", "true")
    pytester.runpytest_inprocess("-q").assert_outcomes(skipped=1, failed=1)
