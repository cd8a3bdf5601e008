"""A copy of a tiny Qwen2-VL checkpoint that vLLM's processor loads: the standard processor class and a
video processor config (the tiny checkpoints are saved image-only). Used by the server tests and the
benchmarks; a real checkpoint needs none of this."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def vllm_checkpoint(model_dir: Path, target: Path) -> Path:
    from transformers import Qwen2VLVideoProcessor

    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(model_dir, target)
    config_path = target / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["processor_class"] = "Qwen2VLProcessor"
    config_path.write_text(json.dumps(config, indent=2))
    image = config["image_processor"]
    keys = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")
    Qwen2VLVideoProcessor(**{key: image[key] for key in keys}).save_pretrained(target)
    return target
