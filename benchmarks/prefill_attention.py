"""Attention over many sequences at once on a CUDA device, the engine's kernels against torch's, per call
of one layer: what a step of prompt chunks and a vision call spend in attention, and whether another
kernel would spend less.

- Prompt chunks, at Qwen2-VL-2B's heads (12 query, 2 KV, head size 128): a step of 16,384 tokens in
  chunks of 276 (a 448x448 image's 256 tokens and a short prompt) and of 788 (an 896x672 image's), each
  with no context, then with 16 keys of cached context before it (a chat template's prefix-cache hit).
  The engine's paged Triton kernel (`triton_attention.paged_prefill_attention`: keys read from the cache
  through a slot table) against torch's FlashAttention-2 varlen kernel over the chunks' own contiguous
  keys, causal: the floor a kernel reading contiguous keys reaches (it cannot read cached context, so
  its rows with context attend to the chunk alone and are not compared).
- A vision call, at Qwen2-VL-2B's tower (16 heads, head size 80): 32,768 patches, 32 images of 1,024
  (448x448) and 8 of 4,096 (896x896), attended within each image. The engine's route (torch's flash varlen
  kernel over the packed rows, `vision_attention`) against SDPA on the images batched by size with
  each of its backends (cuDNN, flash, memory-efficient) that runs them, the copies into its layout
  included.

Each row: microseconds a call (the mean of 50 between CUDA events), TFLOP/s (causal work counted once),
and the largest difference from the first kernel's output.

    python benchmarks/prefill_attention.py [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from cuda_timing import per_call_us, require_cuda, write_report

DEVICE = "cuda"
PAGE_SIZE = 16
STEP_TOKENS = 16384
CHUNK_TOKENS = (276, 788)
CONTEXTS = (0, 16)
LM_HEADS = (12, 2, 128)  # query heads, KV heads, head size
VISION_HEADS = (16, 80)
VISION_PATCHES = 32768
VISION_IMAGES = (1024, 4096)  # patches an image


def prompt_chunks(chunk: int, context: int, device: str = DEVICE) -> dict:
    """A step of prompt chunks of `chunk` tokens after `context` cached keys each, in a paged cache whose
    pages are scattered: the Triton kernel's arguments and the chunks' own q/k/v for torch's."""
    heads, kv_heads, dim = LM_HEADS
    count = STEP_TOKENS // chunk
    keys_each = context + chunk
    pages_each = -(-keys_each // PAGE_SIZE)
    pages = torch.randperm(count * pages_each, device=device).view(count, pages_each)
    offsets = torch.arange(keys_each, device=device)
    slots = pages[:, offsets // PAGE_SIZE] * PAGE_SIZE + offsets % PAGE_SIZE  # (count, keys_each)
    kv = torch.randn(2, kv_heads, count * pages_each * PAGE_SIZE, dim, device=device, dtype=torch.bfloat16)
    query = torch.randn(heads, count * chunk, dim, device=device, dtype=torch.bfloat16)
    own = slots[:, context:].reshape(-1)  # the chunks' own keys, in packed order
    return {
        "count": count,
        "query": query,
        "kv": kv,
        "starts": torch.arange(count, device=device) * chunk,
        "counts": torch.full((count,), chunk, device=device),
        "slots": slots,
        "lengths": torch.full((count,), keys_each, device=device),
        "keys": kv[0][:, own].transpose(0, 1).contiguous(),  # (T, KV heads, D)
        "values": kv[1][:, own].transpose(0, 1).contiguous(),
    }


def causal_flops(count: int, chunk: int, context: int, heads: int, dim: int) -> float:
    """Two matmuls of 2 FLOPs a multiply-add over each query's visible keys."""
    visible = chunk * context + chunk * (chunk + 1) / 2
    return 4 * count * visible * heads * dim


def prompt_rows() -> list[dict]:
    from batchvl.layers.triton_attention import paged_prefill_attention

    heads, kv_heads, dim = LM_HEADS
    scale = dim**-0.5
    rows = []
    for chunk in CHUNK_TOKENS:
        for context in CONTEXTS:
            step = prompt_chunks(chunk, context)
            count = step["count"]
            out = torch.zeros(count * chunk, heads, dim, device=DEVICE, dtype=torch.bfloat16)
            triton = functools.partial(
                paged_prefill_attention,
                out,
                step["query"],
                step["kv"],
                step["starts"],
                step["counts"],
                step["slots"],
                step["lengths"],
                scale,
                chunk,
            )
            flops = causal_flops(count, chunk, context, heads, dim)
            triton_us = per_call_us(triton)
            rows.append(prompt_row("paged_triton", chunk, context, count, triton_us, flops, None))
            q = step["query"].transpose(0, 1).contiguous()  # (T, H, D)
            cumulative = torch.arange(count + 1, device=DEVICE, dtype=torch.int32) * chunk
            flash = functools.partial(
                causal_varlen, q, step["keys"], step["values"], cumulative, chunk, scale
            )
            try:
                flash_us, flash_out = per_call_us(flash), flash()
            except RuntimeError as error:  # no such kernel for these heads in this torch
                rows.append(prompt_row("torch_flash_varlen", chunk, context, count, None, flops, None))
                rows[-1]["error"] = str(error).splitlines()[0][:200]
                continue
            # without context both attend to the same keys; with it, torch's attends to the chunk alone
            diff = (flash_out.float() - out.float()).abs().max().item() if context == 0 else None
            # torch's kernel does the chunk's own work: its TFLOP/s are counted on that
            own_flops = causal_flops(count, chunk, 0, heads, dim)
            rows.append(prompt_row("torch_flash_varlen", chunk, context, count, flash_us, own_flops, diff))
    return rows


def causal_varlen(q, k, v, cumulative, chunk: int, scale: float) -> torch.Tensor:
    """torch's FlashAttention-2 varlen kernel, causal, over the packed chunks (its private op, which every
    torch batchvl supports has: `torch_flash_varlen`)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cumulative, cumulative, chunk, chunk, 0.0, True, False, scale=scale
    )
    return out[0]


def prompt_row(kernel, chunk, context, count, us, flops, diff) -> dict:
    return {
        "case": "prompt_chunks",
        "kernel": kernel,
        "chunk_tokens": chunk,
        "context": context,
        "chunks": count,
        "us": round(us, 1) if us is not None else None,
        "tflop_per_s": round(flops / us / 1e6, 1) if us else None,
        "max_abs_diff": diff,
    }


def vision_rows() -> list[dict]:
    from torch.nn.attention import SDPBackend

    from batchvl.layers.torch_flash_varlen import torch_varlen_function

    heads, dim = VISION_HEADS
    scale = dim**-0.5
    varlen = torch_varlen_function()
    rows = []
    for patches in VISION_IMAGES:
        images = VISION_PATCHES // patches
        q, k, v = (
            torch.randn(VISION_PATCHES, heads, dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(3)
        )
        flops = 4 * images * patches * patches * heads * dim
        cumulative = torch.arange(images + 1, device=DEVICE, dtype=torch.int32) * patches
        reference = None
        kernels = {}
        if varlen is not None:
            kernels["torch_flash_varlen"] = functools.partial(
                varlen, q, k, v, cumulative, cumulative, patches, patches, softmax_scale=scale
            )

        for name, backend in (
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
            ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
            ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
        ):
            kernels[name] = functools.partial(batched_sdpa, backend, q, k, v, images, scale)
        for name, call in kernels.items():
            row = {"case": "vision_call", "kernel": name, "patches_per_image": patches, "images": images}
            try:
                us, out = per_call_us(call), call()
            except RuntimeError as error:  # a backend that does not take these shapes here
                rows.append(
                    {**row, "us": None, "tflop_per_s": None, "error": str(error).splitlines()[0][:200]}
                )
                continue
            if reference is None:
                reference = out
            diff = (out.float() - reference.float()).abs().max().item()
            rows.append(
                {**row, "us": round(us, 1), "tflop_per_s": round(flops / us / 1e6, 1), "max_abs_diff": diff}
            )
    return rows


def batched_sdpa(backend, q, k, v, images: int, scale: float) -> torch.Tensor:
    """SDPA with one `backend` over packed (T, H, D) rows of `images` equal-length images, batched as
    (images, H, patches, D): the layout copies in and out included."""
    from torch.nn.attention import sdpa_kernel

    rows, heads, dim = q.shape
    with sdpa_kernel([backend]):
        shaped = [t.view(images, rows // images, heads, dim).transpose(1, 2) for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*shaped, scale=scale)
    return out.transpose(1, 2).reshape(rows, heads, dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    require_cuda("prefill_attention.py")
    torch.manual_seed(0)
    rows = prompt_rows() + vision_rows()
    for row in rows:
        shape = (
            f"{row['chunks']} chunks of {row['chunk_tokens']} after {row['context']}"
            if row["case"] == "prompt_chunks"
            else f"{row['images']} images of {row['patches_per_image']} patches"
        )
        timing = (
            f"{row['us']:9.1f} us {row['tflop_per_s']:6.1f} TFLOP/s" if row["us"] else row.get("error", "")
        )
        print(f"{row['case']:14} {shape:34} {row['kernel']:20} {timing}  diff {row.get('max_abs_diff')}")
    write_report(args.json, "bfloat16", rows, page_size=PAGE_SIZE, step_tokens=STEP_TOKENS)


if __name__ == "__main__":
    main()
