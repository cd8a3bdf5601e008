"""Image-only Qwen-VL processors that work where torchvision (and so every video processor) is missing.

transformers' `ProcessorMixin` reads its sub-processors from the `__init__` signature, so a subclass that
takes only (image_processor, tokenizer, chat_template) constructs, saves and reloads without a video
processor. They are registered with `AutoProcessor` on import so saved tiny checkpoints load offline.
batchvl's own preprocessing handles video for these families; the processor is used for its chat
template and tokenizer (and, in tests, as the reference for images).
"""

from __future__ import annotations

from transformers import (
    AutoProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
)


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

AutoProcessor.register(Qwen2VLConfig, QwenVLImageOnlyProcessor, exist_ok=True)
AutoProcessor.register(Qwen2_5_VLConfig, Qwen2_5_VLImageOnlyProcessor, exist_ok=True)
AutoProcessor.register(Qwen3VLConfig, Qwen3VLImageOnlyProcessor, exist_ok=True)
