"""What the vision-side mechanisms buy on a captioning job: encoder cache, prefix cache, look-ahead admission.

One engine run per setting, on the same prepared requests (the `small` model, mixed image sizes with a
long tail, a share of duplicate images, two prompts per image), fed the way a job feeds the engine
(at most `lookahead` requests waiting). Each row adds one mechanism to the row above; every row's greedy
outputs are compared with the first row's (in float32 they are equal; in bfloat16 a different batch
composition rounds differently, so a few greedy continuations may part ways).

    python benchmarks/vision_side.py --json benchmarks/results/vision_side.json [--samples 48]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from workloads import markdown_table, mixed_size_images

PROMPTS = [
    "Describe this image in one sentence.",
    "List the main colors and objects you can see in this picture.",
]


def settings(args) -> list[tuple[str, dict]]:
    bare = {"encoder_cache_mb": 0, "prefix_caching": False, "lookahead": 1}
    return [
        ("nothing cached, arrival order", bare),
        ("+ encoder cache", {**bare, "encoder_cache_mb": 512}),
        ("+ prefix cache", {**bare, "encoder_cache_mb": 512, "prefix_caching": True}),
        (
            f"+ look-ahead {args.lookahead} (all defaults)",
            {"encoder_cache_mb": 512, "prefix_caching": True, "lookahead": args.lookahead},
        ),
    ]


def prepare(loaded, count: int, duplicate_share: float, seed: int = 0):
    from batchvl.preprocess.prompts import PromptRenderer
    from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image

    rng = np.random.default_rng(seed)
    unique = mixed_size_images(count, seed)
    images = [
        unique[int(rng.integers(0, i))] if i and rng.random() < duplicate_share else unique[i]
        for i in range(count)
    ]
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    renderer = PromptRenderer(loaded.processor)
    samples = []
    for image in images:
        prepared = prepare_image(image, spec)
        samples.append([(renderer.token_ids(renderer.render(p, 1), [prepared]), prepared) for p in PROMPTS])
    return samples


def run(loaded, samples, limits, max_new_tokens: int):
    from batchvl.engine.engine import Engine
    from batchvl.engine.request import EngineRequest
    from batchvl.engine.sampling.params import SamplingParams

    engine = Engine(loaded.adapter, loaded.processor.tokenizer, limits, loaded.eos_token_ids())
    sampling = SamplingParams(max_new_tokens, ignore_eos=True)
    outputs = {}
    pending = list(enumerate(samples))
    start = time.perf_counter()
    while pending or engine.num_unfinished:
        if pending and engine.wants_requests:
            index, requests = pending.pop(0)
            for prompt_index, (ids, image) in enumerate(requests):
                engine.add_request(EngineRequest(ids, [image], sampling, (index, prompt_index)))
            continue
        for result in engine.step():
            outputs[result.tag] = result.output_token_ids
    return time.perf_counter() - start, engine.stats, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--duplicates", type=float, default=0.25, help="share of samples repeating an image")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lookahead", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from batchvl.config import EngineConfig
    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.models.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(build_tiny_model(Path(tmp) / "small", size="small")), args.dtype, "cpu")
    samples = prepare(loaded, args.samples, args.duplicates)
    base = EngineConfig(max_num_seqs=16, max_num_batched_tokens=1024)
    run(loaded, samples[:4], base, 4)  # warm-up: kernel selection, allocator pools

    # Every setting runs `repeats` times, interleaved with the others so drifts in machine speed hit all
    # of them alike; a row reports its fastest run.
    runs = {name: [] for name, _ in settings(args)}
    for _ in range(args.repeats):
        for name, changes in settings(args):
            runs[name].append(run(loaded, samples, replace(base, **changes), args.max_new_tokens))
    rows, reference = [], None
    for name, results in runs.items():
        seconds, stats, outputs = min(results, key=lambda r: r[0])
        reference = reference or outputs
        same = sum(outputs[tag] == reference[tag] for tag in reference)
        rows.append(
            {
                "setting": name,
                "seconds": round(seconds, 2),
                "samples_per_s": round(len(samples) / seconds, 3),
                "images_encoded": stats.images_encoded,
                "patches_encoded": stats.patches_encoded,
                "encode_s": round(stats.encode_s, 2),
                "prefill_tokens_computed": stats.prefill_tokens_computed,
                "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
                "steps": stats.steps,
                "same_outputs": f"{same}/{len(reference)}",
            }
        )
    first = rows[0]["samples_per_s"]
    for row in rows:
        row["speedup"] = round(row["samples_per_s"] / first, 2)
    requests = len(samples) * len(PROMPTS)
    print(
        f"{len(samples)} samples x {len(PROMPTS)} prompts = {requests} requests, "
        f"{len({s[0][1].content_hash for s in samples})} unique images, "
        f"{args.max_new_tokens} new tokens each, {args.dtype}, {torch.get_num_threads()} threads"
    )
    print(markdown_table(rows))
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
