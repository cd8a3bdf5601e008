"""The supported torch and transformers ranges: declared once for pip and once for the check, and a release
outside them refused in one line (exit 2) before any work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

import batchvl.utils.versions as versions
from batchvl.errors import UserError
from batchvl.models.loader import load_model

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_declares_the_ranges_the_check_holds():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = {req.name: str(req.specifier) for req in map(Requirement, declared)}
    for name, spec in versions.SUPPORTED.items():
        assert requirements[name] == str(Requirement(f"{name}{spec}").specifier)


def test_the_oldest_releases_tested_are_the_floors_of_the_ranges():
    """make test-oldest and make test-oldest-torch install the releases at the bottom of the ranges: raising
    a floor without moving them (or the other way round) fails here."""
    makefile = (ROOT / "Makefile").read_text()
    lines = re.findall(r"^OLDEST(?:_TORCH)? :=(.*)$", makefile, flags=re.MULTILINE)
    pins = dict(pin.split("==") for line in lines for pin in line.split())
    for name, spec in versions.SUPPORTED.items():
        (floor,) = [s.version for s in Requirement(f"{name}{spec}").specifier if s.operator == ">="]
        assert Version(pins[name]) == Version(floor), (name, pins[name], spec)


@pytest.mark.parametrize(
    "installed",
    [
        {"transformers": "5.16.1"},
        {"transformers": "5.25.0"},
        {"transformers": "6.0.0.dev0"},
        {"torch": "2.5.1"},
    ],
    ids=lambda installed: "-".join(map("-".join, installed.items())),
)
def test_a_release_outside_the_range_is_named_in_one_line(monkeypatch, installed):
    monkeypatch.setattr(
        versions, "version", lambda name: installed.get(name, {"torch": "2.13.0+cpu"}.get(name, "5.17.0"))
    )
    ((name, release),) = installed.items()
    with pytest.raises(UserError, match=rf"^{name} {release} is not supported: batchvl needs {name}>="):
        versions.check_library_versions()


@pytest.mark.parametrize(
    "installed",
    [
        {"torch": "2.6.0", "transformers": "5.17.0"},
        {"torch": "2.13.0+cpu", "transformers": "5.24.0"},
        {"torch": "2.7.0a0+ecf3bae", "transformers": "5.20.2"},  # a source build of torch
    ],
)
def test_releases_inside_the_range_pass(monkeypatch, installed):
    monkeypatch.setattr(versions, "version", installed.__getitem__)
    versions.check_library_versions()


def test_the_python_api_refuses_before_reading_the_model(monkeypatch, tmp_path):
    monkeypatch.setattr(versions, "version", {"torch": "2.13.0", "transformers": "5.16.0"}.__getitem__)
    with pytest.raises(UserError, match="^transformers 5.16.0 is not supported"):
        load_model(str(tmp_path / "no-model-here"))


def test_the_command_refuses_an_old_transformers_with_exit_2_before_any_work(tmp_path):
    """A transformers 5.16 distribution first on the import path (as `pip install --target` leaves one)."""
    site = tmp_path / "site"
    metadata = site / "transformers-5.16.0.dist-info" / "METADATA"
    metadata.parent.mkdir(parents=True)
    metadata.write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.16.0\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: {path: model}\ninput: {paths: ['data/*.parquet']}\n"
        "prompts: [{name: caption, text: Describe.}]\noutput: {dir: out}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "batchvl", "run", str(job)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: transformers 5.16.0 is not supported: batchvl needs transformers>=5.17,<5.25 "
        "(install one with `pip install 'transformers>=5.17,<5.25'`)"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("release", ["not-a-version", "5.x", ""])
def test_a_version_that_cannot_be_read_is_refused(monkeypatch, release):
    """A distribution whose metadata holds no valid version (a broken or hand-made install): refused, since
    nothing says it is inside the range."""
    monkeypatch.setattr(versions, "version", {"torch": "2.13.0", "transformers": release}.__getitem__)
    with pytest.raises(UserError, match=f"^transformers {release} is not supported: batchvl needs"):
        versions.check_library_versions()
