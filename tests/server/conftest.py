"""A real vLLM server (its CPU build) on loopback, started once per test module with the `small` model in
fp32, for the openai backend's tests.

vLLM lives in a virtualenv of its own (`bash benchmarks/vllm_env.sh`, which `.ci/run` builds): it pins
other transformers and torch versions than batchvl. Without it the tests skip with that command (in CI a
skip is a failure). The server runs eagerly (`--enforce-eager`): it starts in under half a minute instead
of compiling the model for one or two.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from batchvl.demo.tiny_model import build_tiny_model
from batchvl.demo.vllm_checkpoint import vllm_checkpoint_made_by
from batchvl.server.process import ManagedServer

VLLM_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache" / "batchvl" / "vllm-venv"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
LAUNCH = f"{VLLM_PYTHON} -m vllm.entrypoints.openai.api_server"
SERVER_ARGS = [
    "--max-model-len", "4096", "--limit-mm-per-prompt", '{"image":1,"video":0}', "--enforce-eager",
]  # fmt: skip

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tests' requests need little


def needs_vllm() -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"needs vLLM's CPU build in {VLLM_VENV}: run `bash benchmarks/vllm_env.sh`")


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> Path:
    """The `small` Qwen2-VL checkpoint in the form vLLM's processor loads; the built-in engine loads the
    same folder. Not sharpened (unlike the other tests' models): sharpened attention turns the float
    rounding of vLLM's CPU kernels into other greedy tokens within a few steps; the plain model keeps
    margins wide enough for its greedy text to equal `generate`'s."""
    needs_vllm()
    folder = tmp_path_factory.mktemp("vllm-model")
    build_tiny_model(folder / "source", size="small", seed=0)
    return vllm_checkpoint_made_by(VLLM_PYTHON, folder / "source", folder / "model")


def launch_command(model: Path) -> list[str]:
    return [*shlex.split(LAUNCH), *SERVER_ARGS, "--model", str(model), "--dtype", "float32"]


@pytest.fixture(scope="module")
def vllm_server(vllm_model, tmp_path_factory):
    """A running server of `vllm_model`; its `url` ends in /v1. One per test module, so that no server
    idles in memory beside the rest of the suite."""
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    server = ManagedServer(launch_command(vllm_model), log, startup_timeout_s=600)
    server.start()
    yield server
    server.stop()


def server_job(
    model: Path,
    url: str | None,
    prompts: str,
    out: str = "out",
    sampling: str = "max_new_tokens: 12",
) -> str:
    """A job file over data/*.parquet with `prompts` (YAML list items), on the server at `url` (None: the
    built-in engine)."""
    engine = "engine: {max_num_seqs: 8, kv_cache_mb: 64}"
    if url is not None:
        engine = f"engine: {{backend: openai, server: {{url: '{url}', max_concurrency: 8}}}}"
    return f"""
model: {{path: {model}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts:
{prompts}
sampling: {{{sampling}}}
{engine}
output: {{dir: {out}}}
"""
