"""A job of the openai backend against the fake server (tests/fake_openai_server.py): its input shards and
job file, how it is run (in this process, or as the command line), and its rows read back."""

from __future__ import annotations

import socket
from pathlib import Path

import yaml

from batchvl.config import load_job_config
from batchvl.pipeline.runner import run_job
from tests.conftest import output_rows, write_image_shards

SIZES = [3, 2]  # samples per input shard
PROMPTS = [
    {"name": "caption", "text": "Describe {key}."},
    {"name": "short", "text": "One word for {key}."},
]


def at(url: str, **keys) -> dict:
    """engine.server keys for the server at `url`, with retries that take no time."""
    return {"url": url, "retries": 3, "backoff_s": 0.01, "timeout_s": 5, **keys}


def write_job(root: Path, model_dir, server: dict, sizes=SIZES, prompts=PROMPTS, sampling=None) -> Path:
    """Input shards `data/part-N.parquet` of sizes[N] images keyed `sN-i`, and a job file over them."""
    write_image_shards(root / "data", list(sizes))
    job = {
        "model": {"path": str(model_dir)},
        "input": {"paths": ["data/*.parquet"], "key_column": "key"},
        "prompts": prompts,
        "sampling": {"max_new_tokens": 6, **(sampling or {})},
        "engine": {"backend": "openai", "server": server},
        "preprocess": {"workers": 0},
        "output": {"dir": "out"},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run(job_file: Path, *overrides: str):
    return run_job(load_job_config(job_file, list(overrides)), show_progress=False)


def rows_by_request(root: Path, num_shards: int = len(SIZES)) -> dict[tuple[str, str], dict]:
    rows = output_rows(root / "out", num_shards)
    by_request = {(r["key"], r["prompt"]): r for r in rows}
    assert len(by_request) == len(rows), "a (sample, prompt) has two rows"
    return by_request


def all_requests(sizes=SIZES, prompts=PROMPTS) -> set[tuple[str, str]]:
    return {(f"s{n}-{i}", p["name"]) for n, size in enumerate(sizes) for i in range(size) for p in prompts}


def files_under(folder: Path) -> set[str]:
    """The files a run left under an output folder, but the dataset card (README.md and its per-shard
    summaries), which is rewritten after every commit and is not part of what a commit writes."""
    files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    return {name for name in files if name != "README.md" and not name.startswith("_batchvl/card/")}


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


GONE_SIZES = [2, 2, 2, 2]  # 4 rows a shard with the two prompts
