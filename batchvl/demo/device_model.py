"""A random-weight Qwen2-VL made where it runs: its weights allocated and initialised on the device, in the
dtype it runs in, and handed to the engine as they are.

`build_tiny_model` saves a checkpoint, which at the real sizes (`2b`, `7b`) means initialising billions of
fp32 weights on the CPU and writing and reading gigabytes; a GPU benchmark at those sizes would spend its
minutes there. Only the small files (config, tokenizer, processor) are written, so the folder is a model
folder the job's planning reads like any other; the weights exist on the device alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from batchvl.demo.tiny_model import SIZES, qwen_parts
from batchvl.engine.device.sync import synchronize
from batchvl.errors import UserError

FAMILY = "qwen2_vl"


def build_on_device(
    out_dir: str | Path,
    size: str,
    device: str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    fused_kernels: bool = False,
    vision_attention: str = "auto",
    phases_s: dict[str, float] | None = None,
):
    """A `LoadedModel` of Qwen2-VL at `size` with seeded random weights made on `device` in `dtype` (with
    `fused_kernels`, on CUDA, its elementwise passes as Triton kernels; its tower's attention by
    `vision_attention`, as `engine.vision_attention` takes it), and its small files in out_dir. Where
    `phases_s` is given, the seconds of each phase go in it: the tokenizer and processor (a tokenizer
    trained on the host), the weights made on the device, the model prepared for the engine."""
    from batchvl.models.loader import prepared_model
    from batchvl.models.registry import model_family

    if size not in SIZES:
        raise UserError(f"unknown size '{size}'; supported: {', '.join(SIZES)}")
    phases_s = {} if phases_s is None else phases_s
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_device = torch.device(device)
    started = time.perf_counter()
    parts = qwen_parts(FAMILY, SIZES[size], seed)
    phases_s["processor"] = time.perf_counter() - started
    started = time.perf_counter()
    torch.manual_seed(seed)  # seeds the CUDA generators too: the device's initialisation is repeatable
    model = _constructed(parts, torch_device, dtype)
    synchronize(torch_device)  # (the initialisation's kernels, not just their launch)
    phases_s["weights"] = time.perf_counter() - started
    generation = model.generation_config
    generation.eos_token_id, generation.pad_token_id, generation.bos_token_id = (
        parts.eos,
        parts.endoftext,
        parts.endoftext,
    )
    parts.config.save_pretrained(out)
    generation.save_pretrained(out)
    parts.processor.save_pretrained(out)
    family = model_family(FAMILY)
    started = time.perf_counter()
    loaded = prepared_model(
        model,
        str(out),
        family,
        dtype,
        torch_device,
        fused_kernels=fused_kernels,
        vision_attention=vision_attention,
    )
    synchronize(torch_device)
    phases_s["prepare"] = time.perf_counter() - started
    return loaded


def _constructed(parts, device: torch.device, dtype: torch.dtype):
    """The model with every parameter and buffer created on `device` in `dtype` (the default device and
    dtype while its layers are made, so nothing is allocated elsewhere first) and initialised there."""
    with torch.device(device):
        return parts.model_class._from_config(parts.config, dtype=dtype).eval()


def parameter_count(size: str) -> int:
    """Parameters of Qwen2-VL at `size`, counted on the meta device: shapes only, nothing allocated."""
    parts = qwen_parts(FAMILY, SIZES[size], seed=0)
    model = _constructed(parts, torch.device("meta"), torch.bfloat16)
    return sum(p.numel() for p in model.parameters())
