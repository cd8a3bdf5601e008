"""The largest models' recipe: the openai backend with a launched server that shards the model itself
(`--tensor-parallel-size` in `engine.server.launch_args`). Here vLLM's CPU build over two workers, one core
each: the job's rows are the built-in engine's, and batchvl keeps its commits and resume around it as for
any launched server (tests/server/test_launched_server.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import batchvl
from tests.conftest import write_image_shards
from tests.server.conftest import LAUNCH, SERVER_ARGS, needs_vllm, server_job
from tests.server.test_vllm_server import compared

pytestmark = pytest.mark.timeout(1500)  # builds the checkpoint and starts a two-worker server

TENSOR_PARALLEL = 2


def launched_job(model: Path, out: Path) -> str:
    args = [*SERVER_ARGS, "--tensor-parallel-size", str(TENSOR_PARALLEL)]
    engine = (
        f"engine: {{backend: openai, server: {{launch: '{LAUNCH}', launch_args: {args!r}, "
        "max_concurrency: 4, startup_timeout_s: 600}}"
    )
    plain = server_job(model, None, "  - {name: caption, text: Describe this image.}", out=str(out))
    return plain.replace("engine: {max_num_seqs: 8, kv_cache_mb: 64}", engine)


def test_a_tensor_parallel_server_gives_the_builtin_engines_rows(tmp_path, vllm_model, monkeypatch):
    needs_vllm()
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= TENSOR_PARALLEL, "two cores are needed for two CPU workers"
    # vLLM's CPU workers each bind to a NUMA node of their own unless told which cores to take: one here
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(core) for core in cores[:TENSOR_PARALLEL]))
    write_image_shards(tmp_path / "data", [3, 2])
    rows = {}
    for name in ("builtin", "sharded"):
        job = tmp_path / f"{name}.yaml"
        out = tmp_path / f"out-{name}"
        text = server_job(vllm_model, None, "  - {name: caption, text: Describe this image.}", out=str(out))
        job.write_text(text if name == "builtin" else launched_job(vllm_model, out))
        shutil.rmtree(out, ignore_errors=True)
        batchvl.run(job, progress=False)
        rows[name] = batchvl.read_results(job).to_list()
    log = (tmp_path / "out-sharded" / "_batchvl" / "logs").glob("server*.log")
    assert any(f"tensor_parallel_size={TENSOR_PARALLEL}" in path.read_text() for path in log)
    assert [row["status"] for row in rows["sharded"]] == ["ok"] * 5
    assert compared(rows["sharded"]) == compared(rows["builtin"])
