"""What constrained decoding costs on a labeling job: the same job with and without its constraints.

A labeling workload (the `small` model, random images of mixed sizes): per sample a JSON-schema prompt
(five fields: enums, bounded integers, a boolean and a short string) and a three-way choices prompt
generated under its grammar (`choice_mode: generate`). The
unconstrained job is the same job with the constraints removed, every output held to the length the
constrained job produced for it (so both generate the same number of tokens: the difference is the
grammar work and nothing else). A third job scores the choices (`choice_mode: score`, the default)
instead of generating them under their grammar. Each job runs `--repeats` times, interleaved; a row
reports its fastest run. Reported: samples/s, output tokens/s, and the share of engine step time spent
in grammar work (compiling, filling and applying token masks, advancing matchers: `grammar_s` in the
stats).

    python benchmarks/constrained.py --json benchmarks/results/constrained.json [--samples 200]
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from workloads import markdown_table, mixed_size_images, write_json

SCHEMA = {
    "type": "object",
    "properties": {
        "setting": {"type": "string", "enum": ["indoor", "outdoor", "studio"]},
        "people": {"type": "integer", "minimum": 0, "maximum": 20},
        "main_color": {"type": "string", "enum": ["red", "green", "blue", "black", "white", "other"]},
        "has_text": {"type": "boolean"},
        "subject": {"type": "string", "maxLength": 24},
    },
    "required": ["setting", "people", "main_color", "has_text", "subject"],
}
CHOICES = ["photo", "drawing", "screenshot"]


def write_dataset(folder: Path, count: int) -> None:
    folder.mkdir(parents=True)
    images = []
    for image in mixed_size_images(count, seed=7):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        images.append(buffer.getvalue())
    keys = [f"s{i:05d}" for i in range(count)]
    pq.write_table(pa.table({"key": keys, "image": images}), folder / "part-00000.parquet")


def job(
    model: Path, data: Path, out: Path, constrained: bool, max_new_tokens: int, choice_mode: str = "generate"
) -> dict:
    attrs = {"name": "attrs", "text": "Describe the image as JSON."}
    kind = {"name": "kind", "text": "Is this a photo, a drawing or a screenshot?"}
    sampling = {"max_new_tokens": max_new_tokens}
    if constrained:
        attrs["json_schema"] = SCHEMA
        # generated under the choices' grammar, so both jobs generate the same tokens (scored choices,
        # the default, generate none: the third job)
        kind.update(choices=CHOICES, choice_mode=choice_mode)
    else:  # the constrained run's lengths, from the column `lengths_as_input` adds
        sampling.update(ignore_eos=True, max_new_tokens_field="tokens")
    return {
        "model": {"path": str(model), "dtype": "auto", "device": "cpu"},
        "input": {"paths": [str(data / "*.parquet")], "key_column": "key"},
        "prompts": [attrs, kind],
        "sampling": sampling,
        "output": {"dir": str(out), "overwrite": True},
    }


def run(loaded, cfg_dict: dict) -> dict:
    from batchvl.config import job_config_from_dict
    from batchvl.pipeline.runner import run_job

    return run_job(job_config_from_dict(cfg_dict), loaded=loaded, show_progress=False).stats


def lengths_as_input(constrained_out: Path, data: Path, target: Path) -> None:
    """The input again, with the mean length of each sample's two constrained outputs as its token limit:
    the limit is per sample, so both prompts get it, and a sample generates the same number of tokens in
    total as it did constrained (up to rounding)."""
    rows = pq.read_table(constrained_out / "part-00000.parquet").to_pylist()
    lengths: dict[str, list[int]] = {}
    for row in rows:
        lengths.setdefault(row["key"], []).append(row["num_output_tokens"])
    table = pq.read_table(data / "part-00000.parquet")
    mean = [max(1, round(sum(lengths[key]) / len(lengths[key]))) for key in table["key"].to_pylist()]
    tokens = pa.array(mean, pa.int64())
    target.mkdir(parents=True)
    pq.write_table(table.append_column("tokens", tokens), target / "part-00000.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.models.loader import load_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(tmp / "small", size="small")
        loaded = load_model(str(model), "auto", "cpu")
        write_dataset(tmp / "data", args.samples)
        constrained = job(model, tmp / "data", tmp / "constrained", True, args.max_new_tokens)
        first = run(loaded, constrained)  # also the warm-up
        lengths_as_input(tmp / "constrained", tmp / "data", tmp / "data-lengths")
        free = job(model, tmp / "data-lengths", tmp / "free", False, args.max_new_tokens)
        scored = job(model, tmp / "data", tmp / "scored", True, args.max_new_tokens, "score")
        runs = {"constrained": [first], "unconstrained": [], "choices scored": []}
        for _ in range(args.repeats):
            runs["unconstrained"].append(run(loaded, free))
            runs["constrained"].append(run(loaded, constrained))
            runs["choices scored"].append(run(loaded, scored))
    rows = []
    for name, stats in runs.items():
        best = max(stats[1:] if name == "constrained" else stats, key=lambda s: s["samples_per_s"])
        rows.append(
            {
                "job": name,
                "samples_per_s": best["samples_per_s"],
                "output_tokens_per_s": best["output_tokens_per_s"],
                "output_tokens": best["output_tokens"],
                "grammar_share_of_engine": round(best["grammar_s"] / max(best["engine_s"], 1e-9), 4),
                "rows_ok": best["ok"],
                "rows_error": best["errors"],
                "errors_by_type": best["errors_by_type"],
            }
        )
    cost = 1 - rows[0]["samples_per_s"] / rows[1]["samples_per_s"]
    print(
        f"{args.samples} samples x 2 prompts (JSON schema with 5 fields, 3 choices), small model, "
        f"dtype auto on {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    )
    print(markdown_table(rows))
    print(f"constraints cost {cost:.1%} of samples/s (target: under 15%)")
    scoring = rows[2]["samples_per_s"] / rows[0]["samples_per_s"]
    print(f"scoring the 3 choices instead of generating under their grammar: {scoring:.2f}x the samples/s")
    if args.json:
        result = {
            "args": vars(args) | {"json": str(args.json)},
            "rows": rows,
            "throughput_cost": round(cost, 4),
            "scored_over_generated_choices": round(scoring, 4),
        }
        result["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        write_json(args.json, result)


if __name__ == "__main__":
    main()
