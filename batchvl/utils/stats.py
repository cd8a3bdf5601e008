"""Run counters, merged from the job loop and the engine (given as a dict: this ground layer imports
nothing above it) into one stats JSON per run."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


def processing_seconds(run: dict) -> float:
    """A stats file's processing time, which its rates divide by; files of older versions lack it."""
    return run.get("processing_s", run.get("wall_s", 0) - run.get("model_load_s", 0))


@dataclass
class RunStats:
    mode: str = "run"  # or "retry-failed"
    task: str | None = None  # "I/N" when the run is one task of a split job
    shards_total: int = 0
    shards_skipped: int = 0
    shards_committed: int = 0
    shards_claimed_elsewhere: int = 0  # skipped: another run was on them (or committed them meanwhile)
    samples: int = 0  # samples whose every row has its outcome (committed or not)
    requests: int = 0
    ok: int = 0
    errors: int = 0
    errors_by_type: Counter = field(default_factory=Counter)
    wall_s: float = 0.0
    model_load_s: float = 0.0
    processing_s: float = 0.0  # from the first input read to the last commit: what the rates divide by
    rows_not_committed: int = 0  # rows of shards a stop left unfinished; the next run redoes them
    input_wait_s: float = 0.0  # the engine had nothing to do and waited for prepared samples
    engine_s: float = 0.0  # inside engine steps
    preprocess_s: float = 0.0  # summed over samples, in the workers (runs in parallel with the engine)
    preprocess_workers: int = 0
    worker_restarts: int = 0
    samples_crashed: int = 0
    samples_timed_out: int = 0

    def add_pool(self, pool) -> None:
        """Add the preprocessing pool's counters (its `PoolStats`)."""
        self.worker_restarts += pool.worker_restarts
        self.samples_crashed += pool.samples_crashed
        self.samples_timed_out += pool.samples_timed_out

    def record_row(self, status: str, error_type: str | None) -> None:
        self.requests += 1
        if status == "ok":
            self.ok += 1
        else:
            self.errors += 1
            self.errors_by_type[error_type] += 1

    def to_dict(self, engine: dict) -> dict:
        """This run's counters and the engine's (`engine`: its stats as a dict), with the rates."""
        out = asdict(self)
        out["errors_by_type"] = dict(self.errors_by_type)
        out.update(engine)
        processing = max(self.processing_s, 1e-9)
        out["samples_per_s"] = round(self.samples / processing, 3)
        out["output_tokens_per_s"] = round(engine["output_tokens"] / processing, 3)
        # share of the processing time, the part the input pipeline can starve
        out["input_wait_share"] = round(self.input_wait_s / processing, 4)
        for key in ("input_wait_s", "engine_s", "preprocess_s", "processing_s"):
            out[key] = round(out[key], 3)
        return out
