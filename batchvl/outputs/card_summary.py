"""What the dataset card counts of one committed shard, kept beside the results so that the card is
rebuilt after each commit without reading every shard again: `_batchvl/card/<digest of the shard>.json`
holds the shard's rows by prompt and status, its error types, and the value counts of its label prompts
(choices and regex), read from the committed file's columns once, when it is committed."""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from dataclasses import asdict, dataclass, field

import pyarrow.parquet as pq
import xxhash

from batchvl.storage import layout
from batchvl.storage.output_dir import OutputDir

MOST_VALUES_PER_SHARD = 100  # a regex prompt's distinct values kept per shard; the rest are counted as one


@dataclass
class ShardSummary:
    shard: str
    fingerprint: str  # of the config that wrote the shard
    config: dict  # that config, as the file's metadata records it (credentials left out)
    batchvl_version: str
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)  # prompt -> status -> rows
    error_types: dict[str, int] = field(default_factory=dict)
    labels: dict[str, dict[str, int]] = field(default_factory=dict)  # label prompt -> value -> ok rows
    other_values: dict[str, int] = field(default_factory=dict)  # label prompt -> ok rows of values not kept


def label_prompts(config: dict) -> list[str]:
    """The prompts whose outputs are labels from a closed or patterned set: choices and regex."""
    return [p["name"] for p in config.get("prompts", []) if p.get("choices") or p.get("regex")]


def summarize(out: OutputDir, shard: str, path: str) -> ShardSummary:
    """Count a committed file: its footer's metadata, and the columns the card needs."""
    with out.open(path) as handle:
        parquet = pq.ParquetFile(handle)
        footer = parquet.schema_arrow.metadata or {}
        metadata = {key.decode(): value.decode() for key, value in footer.items()}
        rows = parquet.read(columns=["prompt", "status", "error_type", "text"]).to_pylist()
    config = json.loads(metadata.get("job_config", "{}"))
    summary = ShardSummary(
        shard, metadata.get("config_fingerprint", ""), config, metadata.get("batchvl_version", "")
    )
    labels = set(label_prompts(config))
    values: dict[str, Counter] = {name: Counter() for name in labels}
    errors: Counter = Counter()
    for row in rows:
        by_status = summary.statuses.setdefault(row["prompt"], {})
        by_status[row["status"]] = by_status.get(row["status"], 0) + 1
        if row["status"] == "error":
            errors[row["error_type"] or "unknown"] += 1
        elif row["status"] == "ok" and row["prompt"] in labels:
            values[row["prompt"]][row["text"]] += 1
    summary.error_types = dict(errors)
    for name, counts in values.items():
        kept = dict(counts.most_common(MOST_VALUES_PER_SHARD))
        summary.labels[name] = kept
        summary.other_values[name] = counts.total() - sum(kept.values())
    return summary


def summary_path(out: OutputDir, shard: str) -> str:
    """A flat name per shard (shard names may hold folders): one listing finds every summary."""
    return out.join(layout.CARD, xxhash.xxh3_64_hexdigest(shard.encode()) + ".json")


def write_summary(out: OutputDir, summary: ShardSummary) -> None:
    out.write_text(summary_path(out, summary.shard), json.dumps(asdict(summary), sort_keys=True))


def read_summaries(out: OutputDir, known: set[str]) -> dict[str, ShardSummary]:
    """The summaries in the folder whose file names are not in `known`; unreadable ones are left out."""
    found = {}
    for path in out.list(out.join(layout.CARD), "*.json"):
        name = posixpath.basename(path)
        if name in known:
            continue
        try:
            found[name] = ShardSummary(**json.loads(out.read_text(path)))
        except (OSError, ValueError, TypeError):
            continue  # half-written by hand, or another version's
    return found
