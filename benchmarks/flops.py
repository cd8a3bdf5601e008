"""The throughput benchmark's FLOP counts: the Qwen2-VL parts' FLOPs from the model's own layers, and the
workload's total from batchvl's rows (their prompt and output lengths) and the images' patch counts."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow.parquet as pq
import torch
from throughput_workload import read_part, workload_parts


def linear_params(module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv3d))


class FlopCounter:
    """FLOPs of the Qwen2-VL parts from their layers: 2 per multiply-add of each weight, plus attention."""

    def __init__(self, model_dir: str):
        from transformers import AutoConfig, AutoModelForImageTextToText

        with torch.device("meta"):  # shapes only: no weights read or allocated (the wide model is 6 GB)
            model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir))
        vision, text = model.config.vision_config, model.config.text_config
        inner = model.model
        self.vit_per_patch = 2 * (
            linear_params(inner.visual.patch_embed) + linear_params(inner.visual.blocks)
        )
        self.merge = vision.spatial_merge_size**2
        self.merger_per_token = 2 * linear_params(inner.visual.merger)
        self.vit_attention = 4 * vision.embed_dim * vision.depth  # per patch per patch of its image
        self.lm_per_token = 2 * linear_params(inner.language_model)
        self.head_per_token = 2 * model.lm_head.weight.numel()
        head_dim = text.hidden_size // text.num_attention_heads
        self.lm_attention = (
            4 * text.num_attention_heads * head_dim * text.num_hidden_layers
        )  # per (query, key)
        # K and V of every layer, per token: what a decode reads for each key and a computed token writes
        self.kv_values_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim

    def image(self, patches: int) -> float:
        return patches * (self.vit_per_patch + self.vit_attention * patches) + patches / self.merge * (
            self.merger_per_token
        )

    def prefill(self, start: int, end: int) -> float:
        """Prompt positions start..end-1 (keys: all positions up to each query)."""
        tokens = end - start
        keys = (end * (end + 1) - start * (start + 1)) / 2
        return tokens * self.lm_per_token + keys * self.lm_attention

    def decode(self, prompt: int, generated: int) -> float:
        fed = max(generated - 1, 0)  # the last token is sampled, never fed back
        keys = sum(prompt + k + 1 for k in range(fed))
        return fed * self.lm_per_token + keys * self.lm_attention + generated * self.head_per_token


def workload_flops(counter: FlopCounter, root: Path, dtype_name: str, model_dir: Path) -> dict:
    """From batchvl's own rows (prompt lengths) and the images' patch counts."""
    from PIL import Image

    from batchvl.models.checkpoint_folder import read_model_config
    from batchvl.models.loader import load_processor
    from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image

    processor = load_processor(str(model_dir), read_model_config(str(model_dir)).model_type)
    spec = QwenVisionSpec.from_image_processor(processor.image_processor)
    totals = {"vit": 0.0, "prefill": 0.0, "decode": 0.0, "patches": 0, "prompt_tokens": 0, "requests": 0}
    for part in workload_parts(root):
        patches = {}
        for row in read_part(root, part):
            image = prepare_image(Image.open(io.BytesIO(row["image"])).convert("RGB"), spec)
            patches[row["key"]] = image.num_patches
        (out,) = (root / "out" / dtype_name / part).glob("*.parquet")
        for row in pq.read_table(out).to_pylist():
            prompt, generated = row["num_prompt_tokens"], row["num_output_tokens"]
            totals["vit"] += counter.image(patches[row["key"]])
            totals["prefill"] += counter.prefill(0, prompt)
            totals["decode"] += counter.decode(prompt, generated)
            totals["patches"] += patches[row["key"]]
            totals["prompt_tokens"] += prompt
            totals["requests"] += 1
    return totals
