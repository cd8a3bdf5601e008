"""Kernel launch settings other than the defaults: the fastest a GPU window's kernel benchmarks found, and a
job run with them in the same window.

The Triton kernels read their launch settings (columns and warps a program, keys a block, pipelining
stages) from module constants at each launch (`triton_elementwise`, `triton_grouped_decode`), and
`fused_elementwise.py` and `decode_attention.py` time the kernels under other settings beside the
defaults. `fastest_launches` takes such a report and keeps, for each set of cases that the same settings
were timed on, the settings whose summed time over those cases beats the defaults' by more than `MARGIN`
(these machines are noisy); `fastest_vision_attention` reads `vision_call.py`'s rows for the tower's
attention. `gpu_throughput.py --launch-settings` runs its job with them (`applied`), so that a window
measures what its winners give a whole job before they become the defaults in a commit.

Nothing here imports torch: `make gpu-check`'s runner chooses the settings without starting CUDA.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

# The settings each kernels' module reads at launch; the block sizes and warps are powers of two
TUNABLE = {
    "triton_elementwise": ("BLOCK_COLUMNS", "ELEMENTWISE_WARPS", "NORM_WARPS", "NORM_ROWS"),
    "triton_grouped_decode": ("BLOCK_KEYS", "DECODE_WARPS", "DECODE_STAGES"),
}
POWERS_OF_TWO = {
    "BLOCK_COLUMNS",
    "ELEMENTWISE_WARPS",
    "NORM_WARPS",
    "NORM_ROWS",
    "BLOCK_KEYS",
    "DECODE_WARPS",
}
MARGIN = 0.03  # a setting is kept where it takes at least 3% less time than the defaults
# What identifies a timed case in each kernel benchmark's rows, and its time
ELEMENTWISE_CASE, ELEMENTWISE_TIME = ("op", "rows"), "fused_us"
DECODE_CASE, DECODE_TIME = ("shape", "sequences", "keys"), "grouped_us"
# Each kernels' module: the benchmark whose report times its launch settings, and that report's cases
SWEPT_BY = {
    "triton_elementwise": ("fused_elementwise", ELEMENTWISE_CASE, ELEMENTWISE_TIME),
    "triton_grouped_decode": ("decode_attention", DECODE_CASE, DECODE_TIME),
}


def problem(settings: object) -> str | None:
    """What is wrong with `settings` ({module: {constant: value}}), in one line with its fix; None if
    nothing is."""
    if not isinstance(settings, dict):
        return '--launch-settings takes a JSON object of modules, e.g. {"triton_grouped_decode": {...}}'
    for module, values in settings.items():
        if module not in TUNABLE:
            return f"--launch-settings: no kernels' module {module}; the modules are {', '.join(TUNABLE)}"
        if not isinstance(values, dict):
            return (
                f'--launch-settings: {module} takes an object of settings, e.g. {{"{TUNABLE[module][0]}": 2}}'
            )
        for name, value in values.items():
            if name not in TUNABLE[module]:
                return (
                    f"--launch-settings: {module} has no setting {name}; it has {', '.join(TUNABLE[module])}"
                )
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return f"--launch-settings: {module}.{name} is {value!r}; give a whole number of 1 or more"
            if name in POWERS_OF_TWO and value & (value - 1):
                return f"--launch-settings: {module}.{name} is {value}; give a power of two"
    return None


@contextlib.contextmanager
def applied(settings: dict[str, dict[str, int]]) -> Iterator[None]:
    """The kernels launch with `settings` inside the block; their defaults are put back after it."""
    previous = []
    try:
        for module_name, values in settings.items():
            module = importlib.import_module(f"batchvl.layers.{module_name}")
            for name, value in values.items():
                previous.append((module, name, getattr(module, name)))
                setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(previous):
            setattr(module, name, value)


def fastest_launches(report: dict, case_keys: tuple[str, ...], time_key: str) -> dict[str, int]:
    """From a kernel benchmark's report (`results`: rows timed with the defaults, and rows with a `launch`
    timed with other settings), the settings to launch with: for each set of cases the same settings were
    timed on, those whose summed time beats the defaults' over those cases by more than MARGIN, the
    fastest of them; {} where none does."""
    defaults, swept = {}, {}
    for row in report.get("results", []):
        case = tuple(row[key] for key in case_keys)
        if "launch" in row:
            launch = tuple(sorted(row["launch"].items()))
            swept.setdefault(launch, {})[case] = row[time_key]
        else:
            defaults[case] = row[time_key]
    groups: dict[frozenset, list[tuple]] = {}
    for launch, times in swept.items():
        if set(times) <= set(defaults):
            groups.setdefault(frozenset(times), []).append(launch)
    chosen: dict[str, int] = {}
    for cases, launches in groups.items():
        default_us = sum(defaults[case] for case in cases)
        best = min(launches, key=lambda launch: sum(swept[launch].values()))
        if sum(swept[best].values()) < (1 - MARGIN) * default_us:
            chosen.update(best)
    return chosen


def fastest_of(reports: dict[str, dict | None]) -> dict[str, dict[str, int]]:
    """Per kernels' module, the settings (`fastest_launches`) its benchmark's report found faster than the
    defaults, from `reports` by benchmark name; a module whose report is missing, or found none, is left
    out."""
    chosen = {}
    for module, (benchmark, case_keys, time_key) in SWEPT_BY.items():
        report = reports.get(benchmark)
        if report and (launches := fastest_launches(report, case_keys, time_key)):
            chosen[module] = launches
    return chosen


def fastest_vision_attention(report: dict) -> str | None:
    """`vision_call.py`'s choice for the tower's attention: "sdpa" where SDPA's call (with the fused kernels)
    of the captioning workload's image mix (rows with `image_mix` "job"; in a report without them, at its
    largest size) beats the flash varlen one's wall by more than MARGIN, else None (the default). The calls
    replayed as graphs are not among them: SDPA's calls run eagerly."""
    rows = [
        row for row in report.get("rows", []) if row.get("fused_kernels") and not row.get("vision_graphs")
    ]
    if any(row.get("image_mix") == "job" for row in rows):
        rows = [row for row in rows if row.get("image_mix") == "job"]
    if not rows:
        return None
    largest = max(row["patches"] for row in rows)
    wall = {row["vision_attention"]: row["wall_ms"] for row in rows if row["patches"] == largest}
    if "sdpa" in wall and "flash_varlen" in wall and wall["sdpa"] < (1 - MARGIN) * wall["flash_varlen"]:
        return "sdpa"
    return None
