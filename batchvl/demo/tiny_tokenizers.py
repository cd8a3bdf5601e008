"""Tokenizers for locally built checkpoints: a BPE trained here, in the family's real tokenizer class.

Qwen families and InternVL (Qwen2.5 text) get a byte-level BPE in `Qwen2Tokenizer` with the Qwen special
tokens (InternVL's image tokens too); Llama-style families (LLaVA) a Metaspace BPE with byte fallback in
`LlamaTokenizer` (`<unk> <s> </s>`, the 256 byte tokens), adding BOS like Llama does, plus `<image>` and
`<pad>`; Idefics3 (Llama 3 text) and SmolVLM (SmolLM2 text) a byte-level BPE in a `PreTrainedTokenizerFast`
with their image grid's tokens (their chat templates write the BOS).
"""

from __future__ import annotations

import json
import random

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

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


def _train_bpe(vocab_size: int, seed: int, pre_tokenizer, alphabet: list[str], special: list[str]):
    """(vocab, merges) of a BPE trained on the generated corpus."""
    from tokenizers import Tokenizer, models, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=special, show_progress=False
    )
    bpe.train_from_iterator(_training_corpus(max(20_000, vocab_size * 8), seed), trainer=trainer)
    # The tokenizers API exposes the trained vocab and merges through the serialized model.
    trained = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    return trained["vocab"], merges


def _train_byte_level_bpe(vocab_size: int, seed: int):
    from tokenizers import pre_tokenizers

    return _train_bpe(
        vocab_size,
        seed,
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        pre_tokenizers.ByteLevel.alphabet(),
        [],
    )


def build_qwen_tokenizer(vocab_size: int, seed: int, chat_template: str, named: dict[str, str] | None = None):
    """Qwen2's special tokens, and `named` ones the processor reads as the tokenizer's attributes (InternVL's
    `start_image_token`, ...)."""
    from transformers import Qwen2Tokenizer

    named = named or {}
    vocab, merges = _train_byte_level_bpe(vocab_size - len(QWEN_SPECIAL_TOKENS) - len(named), seed)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        **({"extra_special_tokens": named} if named else {}),
    )
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tokenizer.add_tokens(["<|endoftext|>", *named.values()], special_tokens=True)
    tokenizer.chat_template = chat_template
    return tokenizer


# InternVL's image tokens, by the names its processor reads them from the tokenizer
INTERNVL_IMAGE_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def build_llama_tokenizer(vocab_size: int, seed: int, chat_template: str):
    from tokenizers import pre_tokenizers
    from transformers import LlamaTokenizer

    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    vocab, merges = _train_bpe(
        vocab_size - 2,  # room for <image> and <pad>
        seed,
        # split while training so merges never cross words, as sentencepiece's never do
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        [],
        ["<unk>", "<s>", "</s>", *byte_tokens],
    )
    tokenizer = LlamaTokenizer(
        vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>", eos_token="</s>", add_bos_token=True
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    tokenizer.chat_template = chat_template
    return tokenizer


IMAGE_GRID_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
]


def build_idefics3_tokenizer(vocab_size: int, seed: int, chat_template: str):
    """Llama 3's BOS, EOS and pad tokens, then the image grid's."""
    return _byte_level_tokenizer(
        vocab_size,
        seed,
        chat_template,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
    )


def build_smolvlm_tokenizer(vocab_size: int, seed: int, chat_template: str):
    """SmolVLM2's: SmolLM2's `<|endoftext|>` (unknown), `<|im_start|>` (BOS) and `<|im_end|>` (pad), the
    image grid's tokens, `<end_of_utterance>` the EOS."""
    return _byte_level_tokenizer(
        vocab_size,
        seed,
        chat_template,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )


def _byte_level_tokenizer(vocab_size: int, seed: int, chat_template: str, **special: str):
    """A byte-level BPE in a `PreTrainedTokenizerFast` with `special` (bos_token=..., ...) and the image
    grid's tokens, `vocab_size` tokens in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra = [token for token in IMAGE_GRID_TOKENS if token not in special.values()]
    vocab, merges = _train_byte_level_bpe(vocab_size - len(special) - len(extra), seed)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **{"unk_token": None, **special})
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    tokenizer.chat_template = chat_template
    return tokenizer
