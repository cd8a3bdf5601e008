"""Processors that work where torchvision (and so every video processor) is missing.

transformers' `ProcessorMixin` reads its sub-processors from the `__init__` signature, so a subclass that
takes only (image_processor, tokenizer, chat_template) constructs, saves and reloads without a video
processor. They are registered with `AutoProcessor` on import so that a checkpoint saved with one (its
`processor_class` names it, as `batchvl make-tiny-model` saves them) loads offline.
batchvl's own preprocessing handles video for these families; the processor is used for its chat
template and tokenizer (and, in tests, as the reference for images).

Idefics3's PIL image processor needs no torchvision either, but some transformers releases (5.17 among them)
declare that it does and hand out a placeholder that refuses to construct (`AutoImageProcessor` too); their
own modules give the real classes, and the PIL class is registered by name in the same way.
"""

from __future__ import annotations

from transformers import (
    AutoProcessor,
    Idefics3Config,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
)
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil


class QwenVLImageOnlyProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


class Qwen2_5_VLImageOnlyProcessor(Qwen2_5_VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


class Qwen3VLImageOnlyProcessor(Qwen3VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


IMAGE_ONLY_PROCESSORS = {
    "qwen2_vl": QwenVLImageOnlyProcessor,
    "qwen2_5_vl": Qwen2_5_VLImageOnlyProcessor,
    "qwen3_vl": Qwen3VLImageOnlyProcessor,
}


def _name_key(config_class: type) -> type:
    """A batchvl-owned subclass of a family's config to register a processor (or image processor) under.

    `AutoProcessor` finds a saved `processor_class` by name among registered processors (and
    `AutoImageProcessor` an `image_processor_type` among registered image processors). Some transformers
    releases (5.17 among them) silently skip a registration keyed by a config class transformers itself
    defines, so a key of batchvl's own makes the name resolve on every release. The family's own config
    keeps its stock processor."""
    return type(f"Batchvl{config_class.__name__}", (config_class,), {"__module__": __name__})


for _config, _processor in (
    (Qwen2VLConfig, QwenVLImageOnlyProcessor),
    (Qwen2_5_VLConfig, Qwen2_5_VLImageOnlyProcessor),
    (Qwen3VLConfig, Qwen3VLImageOnlyProcessor),
):
    AutoProcessor.register(_name_key(_config), _processor)

AutoImageProcessor.register(
    _name_key(Idefics3Config), image_processor_classes={"pil": Idefics3ImageProcessorPil}
)
