"""An image-only Qwen-VL processor that works where torchvision (and so every video processor) is missing.

transformers' `ProcessorMixin` reads its sub-processors from the `__init__` signature, so a subclass that
takes only (image_processor, tokenizer, chat_template) constructs, saves and reloads without a video
processor. It is registered with `AutoProcessor` on import so saved tiny checkpoints load offline.
"""

from __future__ import annotations

from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLProcessor


class QwenVLImageOnlyProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


AutoProcessor.register(Qwen2VLConfig, QwenVLImageOnlyProcessor, exist_ok=True)
