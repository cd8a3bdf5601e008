"""Model families batchvl supports, keyed by the Hugging Face config's `model_type`.

A family is everything family-specific in one record: the engine adapter, the preprocessing that turns
media into the vision tower's input and the prompt's placeholder text, which vision attention to plug in,
and what it accepts. The engine, the job and the CLI only ever go through this table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from batchvl.config import PreprocessConfig
from batchvl.errors import UserError
from batchvl.io.types import MediaRef
from batchvl.models.idefics3 import Idefics3Adapter
from batchvl.models.llava import LlavaAdapter
from batchvl.models.qwen_vl import Qwen2_5_VLAdapter, Qwen2VLAdapter, Qwen3VLAdapter
from batchvl.preprocess.clip_vision import clip_media_preparer
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.qwen_vision import QwenMediaPreparer
from batchvl.preprocess.tiled_vision import tiled_media_preparer

MediaPreparer = Callable[[MediaRef], PreparedMedia]


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    adapter: type
    # (processor, HF model config, preprocess config) -> a picklable MediaRef -> PreparedMedia function
    # for worker processes
    media_preparer: Callable[[object, object, PreprocessConfig], MediaPreparer]
    video: bool
    # The vision tower takes packed patches with cu_seqlens (Qwen): plug in batchvl's one-call-per-layer
    # varlen attention. Otherwise (CLIP-style towers over a batch of equal crops) stock SDPA is right.
    varlen_vision: bool


FAMILIES = {
    family.model_type: family
    for family in (
        ModelFamily("qwen2_vl", Qwen2VLAdapter, QwenMediaPreparer.from_config, True, True),
        ModelFamily("qwen2_5_vl", Qwen2_5_VLAdapter, QwenMediaPreparer.from_config, True, True),
        ModelFamily(
            "qwen3_vl",
            Qwen3VLAdapter,
            functools.partial(QwenMediaPreparer.from_config, video_timestamps=True),
            True,
            True,
        ),
        ModelFamily("llava", LlavaAdapter, clip_media_preparer, False, False),
        ModelFamily("idefics3", Idefics3Adapter, tiled_media_preparer, False, False),
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
