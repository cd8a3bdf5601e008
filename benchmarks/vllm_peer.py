"""The throughput benchmark's vLLM method: vLLM's offline `LLM.generate` (its CPU build) on the same rows,
prompts, model and exact output lengths as the other methods. Run by `throughput.py` with the python of
the virtualenv `vllm_env.sh` makes (vLLM pins its own transformers), never imported by batchvl.

vLLM compiles the model with torch.compile when it starts (minutes here), so two times are taken:
start-up, from process start to the first finished request (the workload's first request, alone), and
steady state, the whole workload in one `generate` call after that. The checkpoint is copied beside the
workload with what vLLM's Qwen2-VL processor needs: the standard processor class and a video processor
config (the tiny checkpoints are saved image-only).

Prints one JSON line (the format `throughput.py` reads from its children).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
from matmul_probe import matmul_peak
from PIL import Image
from processes import peak_rss_kb, since_process_start
from throughput_workload import PROMPTS, error_text, requests_of

KV_CACHE_BYTES = 2 << 30


sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # batchvl's source: this venv has not installed it
from batchvl.demo.vllm_checkpoint import vllm_checkpoint  # noqa: E402


def child_pids() -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process().children(recursive=True)]


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--enforce-eager", action="store_true")
    return parser


def main() -> None:
    args = argument_parser().parse_args()

    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    checkpoint = vllm_checkpoint(args.model, args.root / f"vllm-model-{os.getpid()}")
    processor = AutoProcessor.from_pretrained(checkpoint)
    texts = {
        name: processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for name, text in PROMPTS.items()
    }
    llm = LLM(
        model=str(checkpoint),
        dtype=args.dtype,
        seed=0,
        limit_mm_per_prompt={"image": 1, "video": 0},
        enforce_eager=args.enforce_eager,
        # A fixed KV cache, as batchvl's engine.kv_cache_mb: vLLM's default claims 92% of the NUMA node's
        # memory and refuses to start when less is free.
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )

    def generate(requests: list[tuple[str, bytes, str, int]]) -> tuple[list[list], int]:
        """Rows [key, prompt, status, message] and output tokens of one `generate` over `requests`."""
        rows, inputs, params, kept = [], [], [], []
        for key, data, name, tokens in requests:
            try:
                image = Image.open(io.BytesIO(data)).convert("RGB")
            except Exception as error:
                rows.append([key, name, "error", error_text(error)])
                continue
            inputs.append({"prompt": texts[name], "multi_modal_data": {"image": image}})
            params.append(
                SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
            )
            kept.append((key, name, tokens))
        output_tokens = 0
        for (key, name, tokens), out in zip(kept, llm.generate(inputs, params, use_tqdm=False), strict=True):
            generated = len(out.outputs[0].token_ids)
            if generated == tokens:
                rows.append([key, name, "ok", None])
                output_tokens += generated
            else:
                rows.append([key, name, "error", f"generated {generated} tokens, asked for {tokens}"])
        return rows, output_tokens

    requests = requests_of(args.root)
    generate(requests[:1])
    startup = since_process_start()
    start = time.perf_counter()
    rows, output_tokens = generate(requests)
    wall = time.perf_counter() - start
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    result = {
        "wall_s": wall,
        "startup_s": startup,
        "output_tokens": output_tokens,
        "rows": rows,
        "matmul_peak_flops": matmul_peak(dtype),
        # vLLM's engine runs in a child process, still alive here: the peak of each process's resident set
        "peak_rss_mb": round(sum(peak_rss_kb(pid) for pid in child_pids()) / 1024, 1),
        "peak_rss_driver_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    shutil.rmtree(checkpoint, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this module again
    main()
