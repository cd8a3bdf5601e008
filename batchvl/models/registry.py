"""Model families batchvl supports, keyed by the Hugging Face config's `model_type`.

A family is everything family-specific in one record: the engine adapter, the preprocessing that turns
media into the vision tower's input and the prompt's placeholder text, which vision attention to plug in,
and what it accepts. The engine, the job and the CLI only ever go through this table.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from batchvl.config import PreprocessConfig
from batchvl.errors import UserError
from batchvl.inputs.types import MediaRef
from batchvl.preprocess.media import PreparedMedia

MediaPreparer = Callable[[MediaRef], PreparedMedia]


def _resolve(path: str):
    """'package.module:name.attribute' -> that object, its module imported on first use."""
    module, _, attributes = path.partition(":")
    found = importlib.import_module(module)
    for attribute in attributes.split("."):
        found = getattr(found, attribute)
    return found


@dataclass(frozen=True)
class ModelFamily:
    """A family's parts are named by import path and imported when first used, so that listing the
    families (or checking a model folder's type) does not import every family's code."""

    model_type: str
    adapter_path: str  # the engine adapter class
    # (processor, HF model config, preprocess config) -> a picklable MediaRef -> PreparedMedia function
    # for worker processes
    media_preparer_path: str
    video: bool
    # The vision tower takes packed patches with cu_seqlens (Qwen): plug in batchvl's one-call-per-layer
    # varlen attention. Otherwise (CLIP-style towers over a batch of equal crops) stock SDPA is right.
    varlen_vision: bool
    video_timestamps: bool = False  # Qwen3-VL: a timestamp before each video frame

    @property
    def adapter(self) -> type:
        return _resolve(self.adapter_path)

    @property
    def media_preparer(self) -> Callable[[object, object, PreprocessConfig], MediaPreparer]:
        preparer = _resolve(self.media_preparer_path)
        return functools.partial(preparer, video_timestamps=True) if self.video_timestamps else preparer


QWEN_PREPARER = "batchvl.preprocess.qwen_vision:QwenMediaPreparer.from_config"

FAMILIES = {
    family.model_type: family
    for family in (
        ModelFamily("qwen2_vl", "batchvl.models.qwen_vl:Qwen2VLAdapter", QWEN_PREPARER, True, True),
        ModelFamily("qwen2_5_vl", "batchvl.models.qwen_vl:Qwen2_5_VLAdapter", QWEN_PREPARER, True, True),
        ModelFamily(
            "qwen3_vl",
            "batchvl.models.qwen_vl:Qwen3VLAdapter",
            QWEN_PREPARER,
            True,
            True,
            video_timestamps=True,
        ),
        ModelFamily(
            "llava",
            "batchvl.models.llava:LlavaAdapter",
            "batchvl.preprocess.clip_vision:clip_media_preparer",
            False,
            False,
        ),
        ModelFamily(
            "idefics3",
            "batchvl.models.idefics3:Idefics3Adapter",
            "batchvl.preprocess.tiled_vision:tiled_media_preparer",
            False,
            False,
        ),
        ModelFamily(
            "internvl",
            "batchvl.models.internvl:InternVLAdapter",
            "batchvl.preprocess.internvl_video:internvl_media_preparer",
            True,
            False,
        ),
        # SmolVLM2: Idefics3's model with another processor, and video (SmolVLM's first release is `idefics3`)
        ModelFamily(
            "smolvlm",
            "batchvl.models.idefics3:SmolVLMAdapter",
            "batchvl.preprocess.smolvlm_video:smolvlm_media_preparer",
            True,
            False,
        ),
    )
}


def model_family(model_type: str) -> ModelFamily:
    try:
        return FAMILIES[model_type]
    except KeyError:
        supported = ", ".join(sorted(FAMILIES))
        raise UserError(
            f"model type '{model_type}' is not supported; supported model types: {supported}"
        ) from None
