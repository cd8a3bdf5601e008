"""The throughput benchmark's method f: `batchvl run` with `engine.backend: openai` against a vLLM server
(its CPU build, started here as a user starts one), on the same rows, prompts and model as vLLM's own
offline `LLM.generate` (method d, whose settings the server takes: its default threads, a 2 GiB KV cache,
compiled). The difference between f and d is what batchvl's pipeline around the server costs: images
sent as PNG data URLs, HTTP, rows and commits.

Start-up runs from process start to the first result: the server's start and a one-sample job. Peak RSS
is reported for batchvl's process and, apart, for the server's processes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from throughput import VLLM_VENV, run_batchvl

KV_CACHE_BYTES = 2 << 30  # as method d's LLM(kv_cache_memory_bytes=...)
REPO = Path(__file__).resolve().parents[1]


def server_checkpoint(model_dir: Path, target: Path) -> Path:
    """The checkpoint as vLLM's processor loads it, made with vLLM's own python (its transformers)."""
    script = (
        "import sys; from pathlib import Path; from batchvl.demo.vllm_checkpoint import vllm_checkpoint; "
        "vllm_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    python = VLLM_VENV / "bin" / "python"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([str(python), "-c", script, str(model_dir), str(target)], check=True, env=env)
    return target


def peak_rss_mb(pids: list[int]) -> float:
    """The sum of the processes' peak resident sets (VmHWM)."""
    total_kb = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total_kb += int(line.split()[1])
    return round(total_kb / 1024, 1)


def run_batchvl_on_server(root: Path, model_dir: Path, dtype_name: str) -> dict:
    import psutil

    from batchvl.server.process import ManagedServer

    checkpoint = server_checkpoint(model_dir, root / f"server-model-{os.getpid()}")
    command = [
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--dtype", dtype_name, "--seed", "0",
        "--limit-mm-per-prompt", '{"image":1,"video":0}', "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    server = ManagedServer(command, root / f"server-{dtype_name}.log", startup_timeout_s=1200)
    server.start()
    try:
        engine = {"backend": "openai", "server": {"url": server.url}}
        result = run_batchvl(root, str(checkpoint), dtype_name, engine=engine)
        process = psutil.Process(server.process.pid)
        result["peak_rss_server_mb"] = peak_rss_mb([process.pid] + [c.pid for c in process.children(True)])
    finally:
        server.stop()
    return result
