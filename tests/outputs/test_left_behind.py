"""What killed runs leave under `_batchvl/` (temp files of markers, card summaries, claims and stats, and
their claims) is removed when a later run ends; what live runs hold there is kept."""

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from batchvl.config import job_config_from_dict
from batchvl.outputs.claims import STALE_S, Holder
from batchvl.pipeline.runner import run_job
from batchvl.storage.output_dir import TEMP_MAX_AGE_S
from tests.conftest import TEST_DEVICE, write_image_shards


def exited_process_holder() -> Holder:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    holder = Holder.of_process(child.pid)
    child.wait()
    return holder


def put(path: Path, text: str, age_s: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def claim(holder: Holder) -> str:
    return json.dumps(asdict(holder))


def test_a_runs_end_removes_what_killed_runs_left_and_keeps_what_live_runs_hold(tmp_path, loaded_fp32):
    data = tmp_path / "data"
    write_image_shards(data, [1, 1])
    cfg = job_config_from_dict(
        {
            "model": {"path": str(loaded_fp32.path), "dtype": "float32", "device": TEST_DEVICE},
            "input": {"paths": [str(data / "*.parquet")]},
            "prompts": [{"name": "caption", "text": "Describe this image."}],
            "sampling": {"max_new_tokens": 2},
            "preprocess": {"workers": 0},
            "output": {"dir": str(tmp_path / "out")},
        },
        tmp_path,
    )
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    own = Path(cfg.output.dir) / "_batchvl"
    host, dead, old = socket.gethostname(), exited_process_holder(), TEMP_MAX_AGE_S + 60
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = Holder.of_process(live.pid)
        # as a run killed in a recommit leaves them: its temp files, and its claims on committed shards
        left = [
            put(own / "done" / f".part-0.json.tmp-{host}-{dead.pid}", "{half a marker"),
            put(own / "card" / f".0123abcd.json.tmp-{host}-{dead.pid}", "{half a summary"),
            put(own / "stats" / f".run-20250101-000000-{dead.pid}.json.tmp-{host}-{dead.pid}", "{"),
            put(own / "done" / "sub" / ".part-9.json.tmp-elsewhere-42", "{", age_s=old),  # another host's
            put(own / "claims" / f"part-0.parquet.lock.tmp-{uuid.uuid4().hex}", claim(dead), age_s=old),
            put(own / "claims" / f"part-1.parquet.lock.tmp-{uuid.uuid4().hex}-taken", claim(dead), age_s=old),
            put(own / "claims" / "part-1.parquet.lock", claim(dead)),
            put(own / "claims" / "sub" / "part-9.parquet.lock", claim(dead)),
            put(own / "claims" / "far.parquet.lock", claim(Holder("elsewhere", 42, 0.0)), age_s=STALE_S + 60),
        ]
        # what live runs are writing and hold, on this host and on another
        kept = [
            put(own / "done" / f".part-0.json.tmp-{host}-{live.pid}", "{being written"),
            put(own / "card" / ".0123abcd.json.tmp-elsewhere-42", "{being written"),
            put(own / "claims" / f"part-0.parquet.lock.tmp-{uuid.uuid4().hex}", claim(alive)),
            put(own / "claims" / "sub" / "other.parquet.lock", claim(alive)),
            put(own / "claims" / "near.parquet.lock", claim(Holder("elsewhere", 42, 0.0))),
            put(own / "done" / "data.tmp-1.json", "{}", age_s=old),  # a marker, of a shard named so
        ]
        summary = run_job(cfg, loaded=loaded_fp32, show_progress=False)
        assert summary.stats["shards_skipped"] == 2  # nothing to do: only its end cleans
        assert [path for path in left if path.exists()] == []
        assert [path for path in kept if not path.exists()] == []
    finally:
        live.kill()
        live.wait()
