"""A copy of a tiny Qwen2-VL checkpoint that vLLM's processor loads: the standard processor class and a
video processor config (the tiny checkpoints are saved image-only). Used by the server tests and the
benchmarks; a real checkpoint needs none of this.

The video processor needs torchvision, which vLLM's virtualenv has and batchvl's need not:
`vllm_checkpoint_made_by` runs this file as a script with vLLM's python (it imports nothing of batchvl)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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


def vllm_checkpoint_made_by(python: Path, model_dir: Path, target: Path) -> Path:
    """`vllm_checkpoint`, run by another python (vLLM's)."""
    subprocess.run([str(python), __file__, str(model_dir), str(target)], check=True)
    return target


if __name__ == "__main__":
    vllm_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]))
