"""The engine alone on a decode-heavy load, where its host work per step shows in the rate: 160 requests on
the `tiny` model in fp32, each an image (64 to 160 px) and a prompt, decoding 384 tokens past
end-of-sequence, all added at once. Reported: samples/s, the engine's wall time, the model's forward and
the vision tower's time (synchronized on a GPU), steps, and the host time (wall less forward and encode)
per step.

    python benchmarks/decode_heavy.py [--requests 160] [--tokens 384] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from workloads import tiny_model, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from batchvl.config import EngineConfig, PreprocessConfig
    from batchvl.engine.engine import Engine
    from batchvl.engine.request import EngineRequest
    from batchvl.engine.sampling.params import SamplingParams
    from batchvl.inputs.types import MediaRef
    from batchvl.preprocess.prompts import PromptRenderer

    loaded = tiny_model(args.device)
    prepare = loaded.family.media_preparer(loaded.processor, loaded.adapter.model.config, PreprocessConfig())
    renderer = PromptRenderer(loaded.processor)
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(args.requests):
        side = int(rng.integers(64, 161))
        pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        media = [prepare(MediaRef(png.getvalue(), None))]
        rendered = renderer.render("Describe this image.", 1)
        requests.append((renderer.token_ids(rendered, media), media))
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, EngineConfig(), loaded.eos_token_ids())
    sampling = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    started = time.perf_counter()
    for i, (ids, media) in enumerate(requests):
        engine.add_request(EngineRequest(ids, media, sampling, tag=i))
    while engine.num_unfinished:
        engine.step()
    wall = time.perf_counter() - started
    stats = engine.stats
    steps = stats.steps
    host = wall - stats.forward_s - stats.encode_s
    result = {
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "device": args.device,
        "wall_s": round(wall, 2),
        "samples_per_s": round(args.requests / wall, 2),
        "forward_s": round(stats.forward_s, 2),
        "encode_s": round(stats.encode_s, 2),
        "steps": steps,
        "host_ms_per_step": round(host / steps * 1e3, 2),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print(
        f"{args.requests} requests x {args.tokens} tokens: {result['samples_per_s']} samples/s, {wall:.2f} s "
        f"(forward {stats.forward_s:.2f} s, encode {stats.encode_s:.2f} s, {steps} steps, host "
        f"{result['host_ms_per_step']} ms a step)"
    )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
