"""The throughput benchmark's server methods. Method f: `batchvl run` with `engine.backend: openai`
against a vLLM server (its CPU build, started here as a user starts one), on the same rows, prompts and
model as vLLM's own offline `LLM.generate` (method d, whose settings the server takes: its default
threads, a 2 GiB KV cache, compiled). Method g sends the same requests with a minimal asyncio client: g
against d is what the server itself costs (HTTP, its API process), f against g what batchvl's pipeline
around it costs (decoding and checking images, rows, commits).

Start-up runs from process start to the first result: the server's start and a one-sample job. Peak RSS
is reported for batchvl's process and, apart, for the server's processes.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

from batchvl_method import run_batchvl
from processes import peak_rss_kb, since_process_start
from throughput_workload import PROMPTS, requests_of
from vllm_cpu import VLLM_VENV

KV_CACHE_BYTES = 2 << 30  # as method d's LLM(kv_cache_memory_bytes=...)


def started_server(root: Path, model_dir: Path, dtype_name: str):
    """A vLLM server of the checkpoint, started; and the checkpoint's path (the served model's name)."""
    from batchvl.demo.vllm_checkpoint import vllm_checkpoint_made_by
    from batchvl.server.process import ManagedServer

    target = root / f"server-model-{os.getpid()}"
    checkpoint = vllm_checkpoint_made_by(VLLM_VENV / "bin" / "python", model_dir, target)
    command = [
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--dtype", dtype_name, "--seed", "0",
        "--limit-mm-per-prompt", '{"image":1,"video":0}', "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    server = ManagedServer(command, root / f"server-{dtype_name}.log", startup_timeout_s=1200)
    server.start()
    return server, checkpoint


def server_peak_rss_mb(server) -> float:
    import psutil

    process = psutil.Process(server.process.pid)
    pids = [process.pid] + [child.pid for child in process.children(recursive=True)]
    return round(sum(peak_rss_kb(pid) for pid in pids) / 1024, 1)


def run_batchvl_on_server(root: Path, model_dir: Path, dtype_name: str) -> dict:
    """Method f: batchvl run, openai backend, against the server."""
    server, checkpoint = started_server(root, model_dir, dtype_name)
    try:
        engine = {"backend": "openai", "server": {"url": server.url}}
        result = run_batchvl(root, str(checkpoint), dtype_name, engine=engine)
        result["peak_rss_server_mb"] = server_peak_rss_mb(server)
    finally:
        server.stop()
    return result


def run_bare_client(root: Path, model_dir: Path, dtype_name: str) -> dict:
    """Method g: the same requests sent by a minimal asyncio client (64 in flight, images as the data URLs
    of their bytes, no rows, no files): what the server itself costs, apart from batchvl's pipeline."""
    import asyncio

    import httpx

    server, checkpoint = started_server(root, model_dir, dtype_name)
    mime = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg"}

    def body(data: bytes, name: str, tokens: int) -> dict:
        kind = next(m for magic, m in mime.items() if data.startswith(magic))
        url = f"data:{kind};base64," + base64.b64encode(data).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPTS[name]}]
        return {
            "model": str(checkpoint),
            "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens,
            "min_tokens": tokens,
            "temperature": 0.0,
        }

    async def send(requests) -> tuple[list, int]:
        slots = asyncio.Semaphore(64)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:

            async def one(key, data, name, tokens):
                async with slots:
                    response = (await client.post("/chat/completions", json=body(data, name, tokens))).json()
                generated = response["usage"]["completion_tokens"]
                ok = generated == tokens
                return [key, name, "ok" if ok else "error", None if ok else f"{generated} tokens"], generated

            done = await asyncio.gather(*(one(*request) for request in requests))
        return [row for row, _ in done], sum(tokens for _, tokens in done)

    try:
        requests = requests_of(root)
        asyncio.run(send(requests[:1]))
        startup = since_process_start()
        start = time.perf_counter()
        rows, output_tokens = asyncio.run(send(requests))
        wall = time.perf_counter() - start
        result = {"wall_s": wall, "startup_s": startup, "output_tokens": output_tokens, "rows": rows}
        result["peak_rss_server_mb"] = server_peak_rss_mb(server)
    finally:
        server.stop()
    return result
