"""The report's labels section: per choices prompt, how often each choice won and how sure the model was
(a histogram of the winning choice's probability, for scored choices); per JSON-schema prompt, the share
of its rows that are valid JSON following the schema, and why the others are not."""

from __future__ import annotations

import html
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from batchvl.commands.report.svg import histogram_svg
from batchvl.commands.report.tables import table_html
from batchvl.config import JobConfig, PromptConfig


def labels_section(cfg: JobConfig, table: pa.Table) -> str:
    """The section's HTML; empty for a job without choices or JSON-schema prompts."""
    parts = []
    for prompt in cfg.prompts:
        rows = table.filter(pc.equal(table["prompt"], prompt.name))
        if prompt.choices is not None:
            parts.append(_choices_html(prompt, rows))
        elif prompt.json_schema is not None:
            parts.append(_json_html(prompt, rows))
    if not parts:
        return ""
    return f'<section id="labels"><h2>Labels</h2>{"".join(parts)}</section>'


def _choices_html(prompt: PromptConfig, rows: pa.Table) -> str:
    ok = rows.filter(pc.equal(rows["status"], "ok"))
    counts = Counter(ok["text"].to_pylist())
    total = max(ok.num_rows, 1)
    shares = [[choice, f"{counts[choice]:,}", f"{counts[choice] / total:.1%}"] for choice in prompt.choices]
    table = table_html(["label", "rows", "share"], shares, f"labels-{prompt.name}")
    plot = ""
    if "choice_probs" in ok.column_names:
        winning = [round(100 * max(p for _, p in probs)) for probs in ok["choice_probs"].to_pylist() if probs]
        plot = histogram_svg(winning, f"{prompt.name}: probability of the label", "winning choice, %")
    return _label_block(prompt, table + plot)


def _json_html(prompt: PromptConfig, rows: pa.Table) -> str:
    ran = rows.filter(pc.not_equal(rows["status"], "skipped"))
    valid = pc.sum(pc.equal(ran["status"], "ok")).as_py() or 0
    problems = Counter(row["error_type"] for row in ran.filter(pc.equal(ran["status"], "error")).to_pylist())
    why = ", ".join(f"{kind} {count:,}" for kind, count in problems.most_common())
    share = f"{valid / ran.num_rows:.1%}" if ran.num_rows else "n/a"
    others = f"; the others: {html.escape(why)}" if why else ""
    text = f"valid JSON following the schema: <b>{share}</b> ({valid:,} of {ran.num_rows:,} rows){others}"
    return _label_block(prompt, f"<p>{text}</p>")


def _label_block(prompt: PromptConfig, body: str) -> str:
    name = html.escape(prompt.name)
    return f'<div class="bvl-label" data-prompt="{name}"><h3>{name}</h3>{body}</div>'
