"""Build small random-weight VLM checkpoints locally, for tests, the demo and benchmarks.

No model hub is needed: the tokenizer is a byte-level BPE trained here on a generated corpus, loaded
into the family's real tokenizer class with the family's special tokens; the model is built from its
config class with seeded random weights and saved with `save_pretrained`, so it loads offline exactly
like a real checkpoint folder. A random model writes meaningless text; only the shapes are realistic.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from batchvl.errors import UserError

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The Qwen2-VL chat template (one system turn by default, images as vision_start/pad/end).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySize:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2
    vit_depth: int
    vit_dim: int
    vit_heads: int
    min_pixels: int
    max_pixels: int


SIZES = {
    # Seconds to build and run; for tests. head_dim 16 -> mrope_section sums to 8.
    "tiny": TinySize(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mrope_section=(2, 3, 3),
        vit_depth=2,
        vit_dim=64,
        vit_heads=4,
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 64,
    ),
    # ~90M parameters with a 32k vocabulary; for benchmarks. head_dim 64 -> mrope_section sums to 32.
    "small": TinySize(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        mrope_section=(8, 12, 12),
        vit_depth=6,
        vit_dim=512,
        vit_heads=8,
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 256,
    ),
}

FAMILIES = ("qwen2_vl",)

_SYLLABLE_GROUPS = (
    "ka ri to ne sa mi lo be du an el in on or ar en st th ch sh qu pr tr bl gr wa yo ze fi ho ve",
    "cat dog sky red sea sun tree house car road bird blue green white black small large photo image",
)
_SYLLABLES = tuple(" ".join(_SYLLABLE_GROUPS).split())


def _training_corpus(num_words: int, seed: int) -> list[str]:
    """A deterministic text with enough distinct substrings for BPE to learn the requested vocab."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_words // 12):
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(12)]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", ":"]))
    return lines


def build_tokenizer(vocab_size: int, seed: int):
    """Train a byte-level BPE and wrap it in Qwen2Tokenizer with the Qwen special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_corpus(max(20_000, vocab_size * 8), seed), trainer=trainer)
    # The tokenizers API exposes the trained vocab and merges through the serialized model.
    trained = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tokenizer.add_tokens(["<|endoftext|>"], special_tokens=True)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | Path, family: str = "qwen2_vl", size: str = "tiny", seed: int = 0
) -> Path:
    """Write a random-weight checkpoint (model, tokenizer, image processor, chat template) to out_dir."""
    if family not in FAMILIES:
        raise UserError(f"unknown family '{family}'; supported: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise UserError(f"unknown size '{size}'; supported: {', '.join(SIZES)}")
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from batchvl.models.processor import QwenVLImageOnlyProcessor

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, seed)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": max(spec.vocab_size, len(tokenizer)),
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": list(spec.mrope_section),
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": spec.vit_depth,
            "embed_dim": spec.vit_dim,
            "hidden_size": spec.hidden_size,
            "num_heads": spec.vit_heads,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    )
    processor = QwenVLImageOnlyProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN2_VL_CHAT_TEMPLATE
    )
    processor.save_pretrained(out)
    return out
