"""`batchvl report`: one self-contained HTML page about a job's outputs, for people to look at.

Run stats (throughput, cache hit rates, error counts by type), token-length histograms, a gallery of
sampled inputs beside their outputs, and every error row with its message. Everything is inline (CSS,
SVG plots, images as data URIs) and a Content-Security-Policy forbids anything else, so the file can be
mailed or attached to a ticket and shows the same everywhere.
"""

from __future__ import annotations

import html
import posixpath
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from batchvl.commands.labels import current_outputs, ran_output_dir
from batchvl.commands.report.gallery import GALLERY_CSS, gallery_html, gallery_items
from batchvl.commands.report.labels_section import labels_section
from batchvl.commands.report.svg import histogram_svg
from batchvl.commands.report.tables import table_html
from batchvl.config import JobConfig
from batchvl.inputs.sources import job_source
from batchvl.outputs.results import results_table
from batchvl.outputs.run_stats import read_run_stats
from batchvl.storage.output_dir import OutputDir, write_file
from batchvl.utils.stats import processing_seconds
from batchvl.version import __version__

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


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.1%}" if denominator else "n/a"


def _stat(label: str, value: str, detail: str = "") -> str:
    small = f"<small>{html.escape(detail)}</small>" if detail else ""
    return f'<div class="bvl-stat">{html.escape(label)}<b>{html.escape(value)}</b>{small}</div>'


def _summary_section(ok: pa.Table, errors: pa.Table, skipped: int, runs: list[dict], shards: str) -> str:
    rows = ok.num_rows + errors.num_rows + skipped
    job_runs = [r for r in runs if r.get("mode", "run") == "run"]

    def total(key: str) -> float:
        return sum(r.get(key, 0) for r in job_runs)

    busy = sum(processing_seconds(run) for run in job_runs)  # the stats' own denominator
    cards = [
        _stat("shards written", shards),
        _stat("rows ok", f"{ok.num_rows:,}"),
        _stat(
            "error rows", f"{errors.num_rows:,}", _ratio(errors.num_rows, rows) + " of rows" if rows else ""
        ),
        _stat("skipped rows", f"{skipped:,}", "follow-ups whose when did not match"),
        _stat(
            "samples/s", f"{total('samples') / busy:.2f}" if busy else "n/a", "per process, while processing"
        ),
        _stat("output tok/s", f"{total('output_tokens') / busy:.1f}" if busy else "n/a", "per process"),
        _stat(
            "encoder cache hits",
            _ratio(total("encoder_cache_hits"), total("images_total")),
            "of image uses, served without encoding",
        ),
        _stat(
            "prefix cache hits",
            _ratio(total("prefix_cache_hit_tokens"), total("prompt_tokens")),
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
        "skipped": "skipped",
        "wall s": "wall_s",
        "samples/s": "samples_per_s",
        "output tok/s": "output_tokens_per_s",
        "images encoded": "images_encoded",
        "encoder cache hits": "encoder_cache_hits",
        "stopped by": "stopped_by",
    }
    rows = [[run.get(key) for key in columns.values()] for run in runs]
    headers = list(columns)
    return f'<section id="runs"><h2>Runs</h2>{table_html(headers, rows, "runs-table")}</section>'


def _downloads_section(runs: list[dict]) -> str:
    """What fetching URL media did over the job's runs; nothing for a job without URL media."""
    totals = Counter()
    failures = Counter()
    for run in runs:
        for key in ("downloads", "download_bytes", "download_retries", "download_cache_hits"):
            totals[key] += run.get(key, 0)
        failures.update(run.get("download_failures_by_type", {}))
    if not totals["downloads"] and not totals["download_cache_hits"] and not failures:
        return ""
    cards = [
        _stat("downloaded", f"{totals['downloads']:,}", f"{totals['download_bytes'] / 2**20:,.1f} MiB"),
        _stat("from the download cache", f"{totals['download_cache_hits']:,}"),
        _stat(
            "retries", f"{totals['download_retries']:,}", "after a timeout, a refused connection, 429 or 5xx"
        ),
        _stat("failed", f"{sum(failures.values()):,}", "error rows' samples"),
    ]
    rows = [[error_type, count] for error_type, count in failures.most_common()]
    table = table_html(["error_type", "URLs"], rows, "download-failures") if rows else ""
    cards_html = f'<div class="bvl-cards">{"".join(cards)}</div>'
    return f'<section id="downloads"><h2>Downloads</h2>{cards_html}{table}</section>'


def _errors_by_type_section(errors: pa.Table) -> str:
    counts = Counter(errors["error_type"].to_pylist())
    rows = [[error_type, count] for error_type, count in counts.most_common()]
    body = table_html(["error_type", "rows"], rows, "errors-by-type") if rows else "<p>No error rows.</p>"
    return f'<section id="error-types"><h2>Errors by type</h2>{body}</section>'


def _histograms_section(ok: pa.Table) -> str:
    prompt_tokens, output_tokens = ok["num_prompt_tokens"].to_pylist(), ok["num_output_tokens"].to_pylist()
    plots = histogram_svg(prompt_tokens, "Prompt length (ok rows)", "prompt tokens, images included")
    plots += histogram_svg(output_tokens, "Output length (ok rows)", "output tokens")
    return f'<section id="lengths"><h2>Token lengths</h2><div class="bvl-plots">{plots}</div></section>'


def _error_rows_section(errors: pa.Table) -> str:
    columns = ["shard", "key", "prompt", "error_type", "error_message"]
    rows = [[row[c] for c in columns] for row in errors.select(columns).to_pylist()]
    body = table_html(columns, rows, "error-rows") if rows else "<p>No error rows.</p>"
    return f'<section id="errors"><h2>Error rows ({len(rows):,})</h2>{body}</section>'


def build_report(cfg: JobConfig, samples: int = 24, seed: int = 0) -> Report:
    shards = job_source(cfg).list_shards()
    out = OutputDir.of(cfg.output)
    outputs = current_outputs(cfg, out, shards)
    table = results_table(outputs)
    ok = table.filter(pc.equal(table["status"], "ok"))
    errors = table.filter(pc.equal(table["status"], "error"))
    skipped = table.num_rows - ok.num_rows - errors.num_rows
    runs = read_run_stats(out)
    items = gallery_items(cfg, table, samples, seed)
    title = f"batchvl report: {posixpath.basename(out.url.rstrip('/'))}"
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
        + _summary_section(ok, errors, skipped, runs, f"{len(outputs)} / {len(shards)}")
        + _errors_by_type_section(errors)
        + _downloads_section(runs)
        + labels_section(cfg, table)
        + _histograms_section(ok)
        + f'<section id="gallery-section"><h2>Gallery ({len(items)} sampled inputs)</h2>'
        + gallery_html(items, with_style=False)
        + "</section>"
        + _runs_section(runs)
        + _error_rows_section(errors)
        + "</body></html>\n"
    )
    return Report(page, table.num_rows, errors.num_rows, len(items))


def write_report(
    cfg: JobConfig, path: str | None = None, samples: int = 24, seed: int = 0
) -> tuple[str, Report]:
    """Write the report (default: output.dir/report.html), whole; return where, and the report."""
    out = ran_output_dir(cfg)
    report = build_report(cfg, samples, seed)
    target = path or out.join(REPORT_NAME)
    write_file(target, report.html.encode(), cfg.output.storage_options)
    return target, report
