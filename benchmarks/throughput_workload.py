"""The throughput benchmark's workload and its row check: the dataset every method reads (written once as
Parquet: keys, encoded images, each sample's output budget), the prompts, the rows the workload asks for,
and the check that a method wrote each of them once and ok, without which it gets no rate."""

from __future__ import annotations

import collections
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from workloads import mixed_size_images

PROMPTS = {
    "caption": "Describe this image in one sentence.",
    "objects": "List the main colors and objects you can see in this picture.",
}
# Two parts: the first with one prompt per sample, the second with two.
PARTS = {"one_prompt": ["caption"], "two_prompts": ["caption", "objects"]}
# The workload's defaults (`throughput.py`'s options): a share of samples repeating an earlier image, each
# sample's output budget drawn between two lengths, and the share of samples asked both prompts
DUPLICATE_SHARE = 0.15
MIN_TOKENS, MAX_TOKENS = 8, 48
TWO_PROMPT_SHARE = 0.5
SHOWN_ERRORS = 3  # error messages quoted when a method fails its row check


def write_workload(
    root: Path,
    samples: int,
    duplicate_share: float,
    min_tokens: int,
    max_tokens: int,
    two_prompt_share: float,
) -> None:
    rng = np.random.default_rng(0)
    unique = mixed_size_images(samples, seed=0)
    images = [
        unique[int(rng.integers(0, i))] if i and rng.random() < duplicate_share else unique[i]
        for i in range(samples)
    ]
    encoded = []
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG" if i % 2 else "PNG", quality=90)
        encoded.append(buffer.getvalue())
    budgets = rng.integers(min_tokens, max_tokens + 1, size=samples).tolist()
    one = samples - round(samples * two_prompt_share)
    for number, (part, slice_) in enumerate(zip(PARTS, (slice(0, one), slice(one, samples)), strict=True)):
        if slice_.start == slice_.stop:
            # a share of 0 or 1 leaves a part without samples: no job runs it (one over no rows is refused)
            continue
        folder = root / "data" / part
        folder.mkdir(parents=True)
        keys = [f"s{i}" for i in range(samples)][slice_]
        table = pa.table({"key": keys, "image": encoded[slice_], "budget": budgets[slice_]})
        pq.write_table(table, folder / f"part-{number}.parquet")


def workload_parts(root: Path) -> dict[str, list[str]]:
    """The parts `write_workload` wrote under `root`, those holding samples, with their prompts' names."""
    return {part: names for part, names in PARTS.items() if (root / "data" / part).is_dir()}


def read_part(root: Path, part: str) -> list[dict]:
    (path,) = (root / "data" / part).glob("*.parquet")
    return pq.read_table(path).to_pylist()


def requests_of(root: Path) -> list[tuple[str, bytes, str, int]]:
    """(key, image bytes, prompt name, tokens to generate) per request, in dataset order."""
    return [
        (row["key"], row["image"], name, row["budget"]) for part, names in workload_parts(root).items()
        for row in read_part(root, part) for name in names
    ]  # fmt: skip


def expected_rows(root: Path) -> list[tuple[str, str]]:
    """(key, prompt name) of every row the workload asks for: samples x their prompts."""
    return [
        (row["key"], name)
        for part, names in workload_parts(root).items()
        for row in read_part(root, part)
        for name in names
    ]


def error_text(error: BaseException) -> str:
    """The message of an error row, as the methods that run their own loop write it."""
    return f"{type(error).__name__}: {error}"


def check_rows(run: dict, expected: list[tuple[str, str]], described: str) -> dict:
    """The run's row counts, or SystemExit (no rate) unless every expected row is there once and ok.
    `run["rows"]`: [key, prompt, status, error message] each; `described`: the method and dtype, as the
    message names them."""
    rows = run["rows"]
    seen = collections.Counter((key, prompt) for key, prompt, _, _ in rows)
    wanted = set(expected)
    ok = [(key, prompt) for key, prompt, status, _ in rows if status == "ok"]
    errors = [row for row in rows if row[2] != "ok"]
    missing = [pair for pair in expected if pair not in seen]
    extra = sorted(pair for pair, count in seen.items() if pair not in wanted or count > 1)
    problems = []
    # batchvl's runs count their rows in their stats too: those must agree with what its Parquet holds
    if "ok" in run and (run["ok"], run["errors"]) != (len(ok), len(errors)):
        problems.append(
            f"  its stats count {run['ok']} ok and {run['errors']} error rows, its output Parquet "
            f"{len(ok)} and {len(errors)}"
        )
    if errors or missing or extra or problems:
        lines = [
            f"method {described} failed its row check, so no rate is reported: "
            f"rows: {len(ok)} ok, {len(errors)} error, {len(expected)} expected ({len(missing)} missing, "
            f"{len(extra)} duplicate or unexpected)",
            *problems,
            *(f"  error {key} / {prompt}: {message}" for key, prompt, _, message in errors[:SHOWN_ERRORS]),
        ]
        if len(errors) > SHOWN_ERRORS:
            lines.append(f"  ... and {len(errors) - SHOWN_ERRORS} more error rows")
        if missing:
            lines.append(
                f"  missing (key / prompt): {', '.join(f'{k} / {p}' for k, p in missing[:SHOWN_ERRORS])}"
            )
        if extra:
            lines.append(
                f"  duplicate or unexpected: {', '.join(f'{k} / {p}' for k, p in extra[:SHOWN_ERRORS])}"
            )
        raise SystemExit("\n".join(lines))
    prompts_of = collections.Counter(key for key, _ in expected)
    ok_of = collections.Counter(key for key, _ in ok)
    return {
        "rows_expected": len(expected),
        "rows_ok": len(ok),
        "rows_error": len(errors),
        "samples_completed": sum(ok_of[key] == count for key, count in prompts_of.items()),
    }
