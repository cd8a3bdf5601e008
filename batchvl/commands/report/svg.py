"""Histograms as inline SVG: plots in a self-contained page, with no plotting library or script."""

from __future__ import annotations

import html
import math

WIDTH, HEIGHT = 420, 200
MARGIN_LEFT, MARGIN_BOTTOM, MARGIN_TOP = 44, 36, 22


def bins_of(values: list[int], max_bins: int = 24) -> list[tuple[int, int, int]]:
    """(low, high, count) integer bins of equal width covering min..max (high inclusive)."""
    low, high = min(values), max(values)
    width = max(1, math.ceil((high - low + 1) / max_bins))
    counts = [0] * ((high - low) // width + 1)
    for value in values:
        counts[(value - low) // width] += 1
    return [(low + i * width, low + (i + 1) * width - 1, count) for i, count in enumerate(counts)]


def histogram_svg(values: list[int], title: str, x_label: str) -> str:
    """An SVG bar chart of `values`; each bar's tooltip gives its range and count."""
    head = (
        f'<svg class="bvl-hist" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{html.escape(title)}">'
        f'<text x="{WIDTH / 2}" y="14" text-anchor="middle" font-size="13">{html.escape(title)}</text>'
    )
    if not values:
        return head + f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no rows</text></svg>'
    bins = bins_of(values)
    top = max(count for _, _, count in bins)
    plot_w, plot_h = WIDTH - MARGIN_LEFT - 8, HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    bar_w = plot_w / len(bins)
    parts = [head]
    for number, (low, high, count) in enumerate(bins):
        h = plot_h * count / top
        x = MARGIN_LEFT + number * bar_w
        label = f"{low}" if low == high else f"{low}-{high}"
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{MARGIN_TOP + plot_h - h:.1f}" width="{max(bar_w - 2, 1):.1f}" '
            f'height="{h:.1f}" fill="#4a78c2"><title>{label}: {count}</title></rect>'
        )
    base = MARGIN_TOP + plot_h
    parts += [
        f'<line x1="{MARGIN_LEFT}" y1="{base}" x2="{WIDTH - 8}" y2="{base}" stroke="#333"/>',
        f'<text x="{MARGIN_LEFT}" y="{base + 14}" font-size="11">{bins[0][0]}</text>',
        f'<text x="{WIDTH - 8}" y="{base + 14}" font-size="11" text-anchor="end">{bins[-1][1]}</text>',
        f'<text x="{MARGIN_LEFT - 4}" y="{MARGIN_TOP + 10}" font-size="11" text-anchor="end">{top}</text>',
        f'<text x="{MARGIN_LEFT - 4}" y="{base}" font-size="11" text-anchor="end">0</text>',
        f'<text x="{MARGIN_LEFT + plot_w / 2}" y="{HEIGHT - 4}" font-size="12" text-anchor="middle">'
        f"{html.escape(x_label)} ({len(values)} rows)</text>",
        "</svg>",
    ]
    return "".join(parts)
