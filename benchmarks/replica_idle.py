"""When engine replicas wait for requests: the throughput workload's two jobs (`throughput.py`'s, on the
`small` model in fp32, one engine replica a core), each replica's waits for a request timed over each job's
wall and put in tenths of it.

A replica waits when its engine has nothing unfinished. Waits at a job's end, while the other replica still
has requests, are the job's tail: its requests were shared out as they arrived, and one replica's share took
longer to run than the other's. `while_other_busy_s` counts the waits during which another replica held more
than one request, admitted or queued.

    python benchmarks/replica_idle.py [--samples 48] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from batchvl_method import batchvl_job
from throughput_workload import (
    DUPLICATE_SHARE,
    MAX_TOKENS,
    MIN_TOKENS,
    TWO_PROMPT_SHARE,
    workload_parts,
    write_workload,
)
from workloads import write_json

TENTHS = 10
WAIT_S = 0.002  # a call of `_take_requests` that took longer waited for a request


class ReplicaWaits:
    """Each replica's waits for a request, timed by wrapping `EngineReplicas._take_requests` on its class."""

    def __init__(self):
        from batchvl.engine.parallel.replicas import EngineReplicas

        self.cls = EngineReplicas
        self.original = EngineReplicas._take_requests
        self.waits: list[tuple[float, float, int]] = []  # (start, seconds, requests held by the others)
        waits = self.waits
        original = self.original

        def timed(replicas, replica):
            started = time.perf_counter()
            has_work = original(replicas, replica)
            seconds = time.perf_counter() - started
            if seconds > WAIT_S:
                others = sum(
                    other.engine.num_unfinished + other.inbox.qsize()
                    for other in replicas._replicas
                    if other is not replica
                )
                waits.append((started, seconds, others))
            return has_work

        EngineReplicas._take_requests = timed

    def restore(self) -> None:
        self.cls._take_requests = self.original

    def summary(self, started: float, wall: float, replicas: int) -> dict:
        tenths = [0.0] * TENTHS
        for start, seconds, _ in self.waits:
            tenths[min(TENTHS - 1, int(TENTHS * (start - started) / wall))] += seconds
        waited = sum(seconds for _, seconds, _ in self.waits)
        return {
            "wall_s": round(wall, 2),
            "replicas": replicas,
            "waits_s": round(waited, 2),
            "waits_share_of_replica_time": round(waited / (replicas * wall), 4),
            "while_other_busy_s": round(sum(seconds for _, seconds, others in self.waits if others > 1), 2),
            "waits_s_by_tenth_of_wall": [round(seconds, 2) for seconds in tenths],
        }


def measure(work: Path, samples: int, rounds: int) -> list[dict]:
    """The workload of `samples` samples and the `small` model written under `work`, its two jobs run
    `rounds` times: a row of their replicas' waits per job."""
    import torch

    from batchvl.config import EngineConfig
    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.engine.parallel.replicas import replica_count
    from batchvl.models.loader import load_model
    from batchvl.pipeline.runner import run_job

    model_dir = build_tiny_model(work / "model", size="small", seed=0)
    write_workload(work, samples, DUPLICATE_SHARE, MIN_TOKENS, MAX_TOKENS, TWO_PROMPT_SHARE)
    # `auto`'s count for a job of many requests, named: `auto` runs one engine for a job of a few
    replicas = {"replicas": replica_count(EngineConfig(), torch.device("cpu"), under_torchrun=False)}
    loaded = load_model(str(model_dir), dtype="float32", device="cpu")
    model = {"path": str(model_dir), "dtype": "float32", "device": "cpu"}
    rows = []
    for round_number in range(rounds):
        for part, names in workload_parts(work).items():
            waits = ReplicaWaits()
            try:
                started = time.perf_counter()
                out = work / f"out{round_number}" / part
                job = batchvl_job(work / "data" / part, names, out, model, replicas)
                stats = run_job(job, loaded=loaded, show_progress=False).stats
                wall = time.perf_counter() - started
            finally:
                waits.restore()
            row = {
                "round": round_number,
                "job": part,
                **waits.summary(started, wall, stats["engine_replicas"]),
            }
            print(
                f"round {round_number} {part}: wall {row['wall_s']} s, {row['replicas']} replicas waited "
                f"{row['waits_s']} s ({row['waits_share_of_replica_time']:.1%} of their time), "
                f"{row['while_other_busy_s']} s of it while another held requests; by tenth of the wall: "
                + " ".join(f"{seconds:.1f}" for seconds in row["waits_s_by_tenth_of_wall"])
            )
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for name in ("samples", "rounds"):
        if getattr(args, name) < 1:
            parser.exit(2, f"error: --{name} {getattr(args, name)} runs nothing; give 1 or more\n")

    with tempfile.TemporaryDirectory() as work:
        rows = measure(Path(work), args.samples, args.rounds)
    write_json(args.json, {"samples": args.samples, "model_size": "small", "dtype": "float32", "jobs": rows})


if __name__ == "__main__":
    main()
