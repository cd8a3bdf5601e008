"""`batchvl report`: one self-contained HTML page about a job's outputs, for people to look at.

Run stats (throughput, cache hit rates, error counts by type), token-length histograms, a gallery of
sampled inputs beside their outputs, and every error row with its message. Everything is inline (CSS,
SVG plots, images as data URIs) and a Content-Security-Policy forbids anything else, so the file can be
mailed or attached to a ticket and shows the same everywhere.
"""

from __future__ import annotations

import glob
import html
import json
import os
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from batchvl import __version__
from batchvl.config import JobConfig
from batchvl.io.results import results_table
from batchvl.io.sources import make_source
from batchvl.io.writers import write_text_atomic
from batchvl.report.gallery import GALLERY_CSS, gallery_html, gallery_items
from batchvl.report.svg import histogram_svg

REPORT_NAME = "report.html"
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

PAGE_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#f6f7f9}
h1{margin-bottom:0} .bvl-sub{color:#667;margin-top:4px}
section{margin:24px 0}
.bvl-cards{display:flex;flex-wrap:wrap;gap:12px}
.bvl-stat{background:#fff;border:1px solid #ccd;border-radius:6px;padding:10px 14px;min-width:150px}
.bvl-stat b{display:block;font-size:22px}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #ccd;padding:4px 8px;text-align:left;vertical-align:top;font-size:13px}
.bvl-plots{display:flex;flex-wrap:wrap;gap:16px}
.bvl-plots svg{background:#fff;border:1px solid #ccd;border-radius:6px}
"""


@dataclass(frozen=True)
class Report:
    html: str
    rows: int
    errors: int
    gallery_samples: int


def run_stats(out_dir: str) -> list[dict]:
    """Every run's stats file, oldest first (the names start with the run's start time)."""
    paths = sorted(glob.glob(os.path.join(glob.escape(out_dir), "_batchvl", "stats", "run-*.json")))
    runs = []
    for path in paths:
        with open(path) as f:
            stats = json.load(f)
        stats["file"] = os.path.basename(path)
        runs.append(stats)
    return runs


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.1%}" if denominator else "n/a"


def _stat(label: str, value: str, detail: str = "") -> str:
    small = f"<small>{html.escape(detail)}</small>" if detail else ""
    return f'<div class="bvl-stat">{html.escape(label)}<b>{html.escape(value)}</b>{small}</div>'


def _table(headers: list[str], rows: list[list], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape('' if v is None else str(v))}</td>" for v in row) + "</tr>"
        for row in rows
    )
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _summary_section(table: pa.Table, runs: list[dict], shards_total: int) -> str:
    statuses = Counter(table["status"].to_pylist())
    rows, errors = table.num_rows, table.num_rows - statuses["ok"]
    job_runs = [r for r in runs if r.get("mode", "run") == "run"]
    samples = sum(r["samples"] for r in job_runs)
    busy = sum(r["wall_s"] - r.get("model_load_s", 0.0) for r in job_runs)
    output_tokens = sum(r.get("output_tokens", 0) for r in job_runs)
    shards_done = len(set(table["shard"].to_pylist()))
    cards = [
        _stat("shards written", f"{shards_done} / {shards_total}"),
        _stat("rows ok", f"{statuses['ok']:,}"),
        _stat("error rows", f"{errors:,}", _ratio(errors, rows) + " of rows" if rows else ""),
        _stat("samples/s", f"{samples / busy:.2f}" if busy else "n/a", "per process, after model load"),
        _stat("output tok/s", f"{output_tokens / busy:.1f}" if busy else "n/a", "per process"),
        _stat(
            "encoder cache hits",
            _ratio(
                sum(r.get("encoder_cache_hits", 0) for r in job_runs),
                sum(r.get("images_total", 0) for r in job_runs),
            ),
            "of image uses, served without encoding",
        ),
        _stat(
            "prefix cache hits",
            _ratio(
                sum(r.get("prefix_cache_hit_tokens", 0) for r in job_runs),
                sum(r.get("prompt_tokens", 0) for r in job_runs),
            ),
            "of prompt tokens, not computed again",
        ),
    ]
    return f'<section id="summary"><h2>Summary</h2><div class="bvl-cards">{"".join(cards)}</div></section>'


def _runs_section(runs: list[dict]) -> str:
    columns = {
        "stats file": "file",
        "mode": "mode",
        "task": "task",
        "samples": "samples",
        "ok": "ok",
        "errors": "errors",
        "wall s": "wall_s",
        "samples/s": "samples_per_s",
        "output tok/s": "output_tokens_per_s",
        "images encoded": "images_encoded",
        "encoder cache hits": "encoder_cache_hits",
        "stopped by": "stopped_by",
    }
    rows = [[run.get(key) for key in columns.values()] for run in runs]
    headers = list(columns)
    return f'<section id="runs"><h2>Runs</h2>{_table(headers, rows, "runs-table")}</section>'


def _errors_by_type_section(table: pa.Table) -> str:
    counts = Counter(
        t
        for t, s in zip(table["error_type"].to_pylist(), table["status"].to_pylist(), strict=True)
        if s != "ok"
    )
    rows = [[error_type, count] for error_type, count in counts.most_common()]
    body = _table(["error_type", "rows"], rows, "errors-by-type") if rows else "<p>No error rows.</p>"
    return f'<section id="error-types"><h2>Errors by type</h2>{body}</section>'


def _histograms_section(table: pa.Table) -> str:
    ok = [s == "ok" for s in table["status"].to_pylist()]
    prompt_tokens = [v for v, keep in zip(table["num_prompt_tokens"].to_pylist(), ok, strict=True) if keep]
    output_tokens = [v for v, keep in zip(table["num_output_tokens"].to_pylist(), ok, strict=True) if keep]
    plots = histogram_svg(prompt_tokens, "Prompt length (ok rows)", "prompt tokens, images included")
    plots += histogram_svg(output_tokens, "Output length (ok rows)", "output tokens")
    return f'<section id="lengths"><h2>Token lengths</h2><div class="bvl-plots">{plots}</div></section>'


def _error_rows_section(table: pa.Table) -> str:
    columns = ["shard", "key", "prompt", "error_type", "error_message"]
    errors = table.filter(pa.array([s != "ok" for s in table["status"].to_pylist()], pa.bool_()))
    rows = [[row[c] for c in columns] for row in errors.select(columns).to_pylist()]
    body = _table(columns, rows, "error-rows") if rows else "<p>No error rows.</p>"
    return f'<section id="errors"><h2>Error rows ({len(rows):,})</h2>{body}</section>'


def build_report(cfg: JobConfig, samples: int = 24, seed: int = 0) -> Report:
    table = results_table(cfg)
    runs = run_stats(cfg.output.dir)
    shards_total = len(make_source(cfg.input).list_shards())
    items = gallery_items(cfg, table, samples, seed)
    title = f"batchvl report: {os.path.basename(cfg.output.dir.rstrip(os.sep))}"
    subtitle = (
        f"output {cfg.output.dir} · model {cfg.model.path} · written {time.strftime('%Y-%m-%d %H:%M:%S')} · "
        f"batchvl {__version__}"
    )
    page = (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f"<title>{html.escape(title)}</title><style>{PAGE_CSS}{GALLERY_CSS}</style></head><body>"
        f'<h1>{html.escape(title)}</h1><p class="bvl-sub">{html.escape(subtitle)}</p>'
        + _summary_section(table, runs, shards_total)
        + _errors_by_type_section(table)
        + _histograms_section(table)
        + f'<section id="gallery-section"><h2>Gallery ({len(items)} sampled inputs)</h2>'
        + gallery_html(items, with_style=False)
        + "</section>"
        + _runs_section(runs)
        + _error_rows_section(table)
        + "</body></html>\n"
    )
    errors = table.num_rows - sum(s == "ok" for s in table["status"].to_pylist())
    return Report(page, table.num_rows, errors, len(items))


def write_report(
    cfg: JobConfig, path: str | None = None, samples: int = 24, seed: int = 0
) -> tuple[str, Report]:
    """Write the report (default: output.dir/report.html) atomically; return where, and the report."""
    report = build_report(cfg, samples, seed)
    target = path or os.path.join(cfg.output.dir, REPORT_NAME)
    write_text_atomic(target, report.html)
    return target, report
