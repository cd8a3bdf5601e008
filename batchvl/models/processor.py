"""Processors that work where torchvision (and so every video processor) is missing.

transformers' `ProcessorMixin` reads its sub-processors from the `__init__` signature, so a subclass that
takes only (image_processor, tokenizer, chat_template) constructs, saves and reloads without a video
processor. They are registered with `AutoProcessor` on import so that a checkpoint saved with one (its
`processor_class` names it, as `batchvl make-tiny-model` saves them) loads offline.
batchvl's own preprocessing handles video for these families; the processor is used for its chat template
and tokenizer (and, in tests, as the reference for images).

SmolVLM's processor also refuses to construct without num2words, which only its video prompts use (they
spell the frame count out); batchvl's image-only one sets its attributes itself and does not ask for it.

Idefics3's (and SmolVLM's, and InternVL's GOT-OCR2) PIL image processor needs no torchvision either, but
some transformers releases (5.17 among them) declare that it does and hand out a placeholder that refuses
to construct (`AutoImageProcessor` too); their own modules give the real classes, and the PIL classes are
registered by name in the same way.
"""

from __future__ import annotations

from transformers import (
    AutoProcessor,
    Idefics3Config,
    InternVLConfig,
    InternVLProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
    SmolVLMConfig,
    SmolVLMProcessor,
)
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.processing_utils import ProcessorMixin


class QwenVLImageOnlyProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


class Qwen2_5_VLImageOnlyProcessor(Qwen2_5_VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


class Qwen3VLImageOnlyProcessor(Qwen3VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


class InternVLImageOnlyProcessor(InternVLProcessor):
    def __init__(
        self, image_processor=None, tokenizer=None, image_seq_length: int = 256, chat_template=None, **kwargs
    ):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            image_seq_length=image_seq_length,
            chat_template=chat_template,
        )


class SmolVLMImageOnlyProcessor(SmolVLMProcessor):
    """SmolVLM's image prompts and chat template, without its video processor and num2words: the attributes
    `SmolVLMProcessor.__init__` sets, then the mixin's own construction."""

    def __init__(
        self, image_processor=None, tokenizer=None, image_seq_len: int = 169, chat_template=None, **kwargs
    ):
        self.fake_image_token = getattr(tokenizer, "fake_image_token", "<fake_token_around_image>")
        self.image_token = getattr(tokenizer, "image_token", "<image>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.end_of_utterance_token = getattr(tokenizer, "end_of_utterance_token", "<end_of_utterance>")
        self.global_image_token = getattr(tokenizer, "global_image_token", "<global-img>")
        self.image_seq_len = image_seq_len
        self.video_token = getattr(tokenizer, "video_token", "<video>")
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        # SmolVLMProcessor's own adds its video processor's frame defaults to every call
        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)


IMAGE_ONLY_PROCESSORS = {
    "qwen2_vl": QwenVLImageOnlyProcessor,
    "qwen2_5_vl": Qwen2_5_VLImageOnlyProcessor,
    "qwen3_vl": Qwen3VLImageOnlyProcessor,
    "smolvlm": SmolVLMImageOnlyProcessor,
    "internvl": InternVLImageOnlyProcessor,
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
    (SmolVLMConfig, SmolVLMImageOnlyProcessor),
    (InternVLConfig, InternVLImageOnlyProcessor),
):
    AutoProcessor.register(_name_key(_config), _processor)

for _config, _image_processor in (
    (Idefics3Config, Idefics3ImageProcessorPil),
    (SmolVLMConfig, SmolVLMImageProcessorPil),
    (InternVLConfig, GotOcr2ImageProcessorPil),
):
    AutoImageProcessor.register(_name_key(_config), image_processor_classes={"pil": _image_processor})
