"""Run counters: each component owns a `Counters` dataclass of its own, and a run's stats JSON is the
job loop's `RunStats` merged with them (passed in as dataclasses: this ground layer imports nothing above
it)."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace

from batchvl.errors import RowStatus


def add_counts(a, b):
    if isinstance(a, list):  # per-rank counts: added rank by rank, the shorter padded with zeros
        longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
        return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]
    return a + b


class Counters:
    """A dataclass whose fields are counters (numbers, per-rank lists, `Counter`s) that add field by
    field: the stats of two runs, two ranks or two parts of a component are their sum."""

    def __add__(self, other: Counters) -> Counters:
        if type(other) is not type(self):
            return NotImplemented
        sums = {f.name: add_counts(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)}
        return replace(self, **sums)


def processing_seconds(run: dict) -> float:
    """A stats file's processing time, which its rates divide by; files of older versions lack it."""
    return run.get("processing_s", run.get("wall_s", 0) - run.get("model_load_s", 0))


def add_rates(stats: dict, engines: int = 1) -> None:
    """A run's rates from its counts, over its processing time: samples and output tokens a second, and
    the share of the processing time its `engines` (each their own) waited for input, the part the input
    pipeline can starve."""
    processing = max(stats["processing_s"], 1e-9)
    stats["samples_per_s"] = round(stats["samples"] / processing, 3)
    stats["output_tokens_per_s"] = round(stats["output_tokens"] / processing, 3)
    stats["input_wait_share"] = round(stats["input_wait_s"] / (processing * engines), 4)


@dataclass
class RunStats:  # not Counters: its mode and task name the run
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
    skipped: int = 0  # follow-up prompts whose `when` did not match
    errors_by_type: Counter = field(default_factory=Counter)
    wall_s: float = 0.0
    model_load_s: float = 0.0
    workers_start_s: float = 0.0  # waiting for the preprocessing workers' forks, before the weights load
    engine_start_s: float = 0.0  # building the engine (the weights loaded): step sizes, KV cache, graphs
    processing_s: float = 0.0  # from the engine's start to the last commit: what the rates divide by
    rows_not_committed: int = 0  # rows of shards a stop left unfinished; the next run redoes them
    rows_kept: int = 0  # committed rows of unchanged prompts, kept in the shards written again
    rows_dropped: Counter = field(default_factory=Counter)  # prompt no longer in the job -> its rows gone
    input_wait_s: float = 0.0  # the engine had nothing to do and waited for prepared samples
    engine_s: float = 0.0  # inside engine steps
    preprocess_s: float = 0.0  # summed over samples, in the workers (runs in parallel with the engine)
    preprocess_workers: int = 0

    def record_row(self, status: RowStatus, error_type: str | None) -> None:
        self.requests += 1
        if status == "ok":
            self.ok += 1
        elif status == "skipped":
            self.skipped += 1
        else:
            self.errors += 1
            self.errors_by_type[error_type] += 1

    def to_dict(self, *components: Counters) -> dict:
        """This run's counters and its components' (the engine's `output_tokens` among them), with the
        rates, as one flat dict."""
        out = asdict(self)
        out["errors_by_type"] = dict(self.errors_by_type)
        out["rows_dropped"] = dict(self.rows_dropped)
        for counters in components:
            # not asdict: it rebuilds a Counter from its (key, count) pairs, counting the pairs
            for f in fields(counters):
                value = getattr(counters, f.name)
                out[f.name] = dict(value) if isinstance(value, Counter) else copy.copy(value)
        add_rates(out)
        for key in ("input_wait_s", "engine_s", "preprocess_s", "processing_s"):
            out[key] = round(out[key], 3)
        return out
