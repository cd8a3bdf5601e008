"""Build small random-weight VLM checkpoints locally, for tests, the demo and benchmarks.

No model hub is needed: the tokenizer is a BPE trained here, loaded into the family's real tokenizer
class with the family's special tokens; the model is built from its config class with seeded random
weights and saved with `save_pretrained` beside its processor, so it loads offline exactly like a real
checkpoint folder. A random model writes meaningless text; only the shapes are realistic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from batchvl.demo import chat_templates
from batchvl.demo.tiny_tokenizers import (
    INTERNVL_IMAGE_TOKENS,
    QWEN_SPECIAL_TOKENS,
    build_idefics3_tokenizer,
    build_llama_tokenizer,
    build_qwen_tokenizer,
    build_smolvlm_tokenizer,
)
from batchvl.errors import UserError


@dataclass(frozen=True)
class TinySize:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vit_depth: int
    vit_dim: int
    vit_heads: int
    merged_patches: tuple[int, int]  # Qwen: fewest and most merged patches per image (pixel limits)
    clip_image_size: int  # LLaVA: the square crop side
    tile_size: int  # Idefics3: the tile side (an even number of 14-pixel patches, for the pixel shuffle)
    # Qwen2-VL-2B shares its input embedding with its output head
    tied_embeddings: bool = False
    # The locally trained tokenizer's vocabulary; the model's may be larger (ids no text reaches), since
    # training a BPE to a real model's 151,936 tokens would take minutes on the small text it learns from
    tokenizer_vocab: int | None = None
    vit_intermediate: int | None = None  # the vision MLP's width (SigLIP's 4x); None: 2 x vit_dim

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def vit_mlp_size(self) -> int:
        return self.vit_intermediate or 2 * self.vit_dim

    def mrope_section(self, interleaved: bool) -> list[int]:
        """Rope frequencies per (t, h, w) axis, summing to head_dim / 2, in the real checkpoints' ratios:
        Qwen2-VL 16:24:24, Qwen3-VL (interleaved) 24:20:20."""
        half = self.head_dim // 2
        if interleaved:
            spatial = half * 5 // 16
            return [half - 2 * spatial, spatial, spatial]
        temporal = half // 4
        return [temporal, (half - temporal) // 2, half - temporal - (half - temporal) // 2]


SIZES = {
    # Seconds to build and run; for tests. head_dim 16.
    "tiny": TinySize(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vit_depth=2,
        vit_dim=64,
        vit_heads=4,
        merged_patches=(4, 64),
        clip_image_size=56,
        tile_size=84,
    ),
    # ~90M parameters with a 32k vocabulary; for benchmarks. head_dim 64.
    "small": TinySize(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        vit_depth=6,
        vit_dim=512,
        vit_heads=8,
        merged_patches=(4, 256),
        clip_image_size=224,
        tile_size=252,
    ),
    # Qwen2-VL-2B's widths and depths (1.5B parameters with this vocabulary); for GPU benchmarks at real
    # width. head_dim 128.
    "wide": TinySize(
        vocab_size=32768,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        vit_depth=32,
        vit_dim=1280,
        vit_heads=16,
        merged_patches=(4, 1024),
        clip_image_size=336,
        tile_size=364,
    ),
    # The real Qwen2-VL-2B and -7B (Qwen/Qwen2-VL-2B-Instruct's and -7B-Instruct's config.json: 1,536 and
    # 3,584 wide, 28 layers, 12 heads over 2 KV heads and 28 over 4; the same vision tower, 32 blocks of
    # 1,280 with 16 heads; vocabularies of 151,936 and 152,064, the 2B's tied), random weights, for GPU
    # benchmarks at the real sizes; the image processor's pixel limits are the real ones (3,136 to
    # 12,845,056 pixels). About 2.2B and 8.3B parameters.
    "2b": TinySize(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        vit_depth=32,
        vit_dim=1280,
        vit_heads=16,
        merged_patches=(4, 16384),
        clip_image_size=336,
        tile_size=364,
        tied_embeddings=True,
        tokenizer_vocab=32768,
    ),
    "7b": TinySize(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        vit_depth=32,
        vit_dim=1280,
        vit_heads=16,
        merged_patches=(4, 16384),
        clip_image_size=336,
        tile_size=364,
        tokenizer_vocab=32768,
    ),
}
# SmolVLM2-256M's whole configuration (HuggingFaceTB/SmolVLM2-256M-Video-Instruct's config.json: SmolLM2's
# 576-wide text of 30 layers, 9 heads over 3 KV heads, 49,280 tokens, tied; a SigLIP tower of 12 layers of 768
# with 12 heads and 3,072-wide MLPs over 512-pixel tiles), random weights; for CPU benchmarks of a model CPU
# users run (`--family smolvlm`). About 0.22B parameters.
SIZES["256m"] = TinySize(
    vocab_size=49280,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    vit_depth=12,
    vit_dim=768,
    vit_heads=12,
    merged_patches=(4, 1024),
    clip_image_size=336,
    tile_size=512,
    tied_embeddings=True,
    tokenizer_vocab=32768,
    vit_intermediate=3072,
)
# The tiny model's layers with the real image processor's pixel limits: a 448x448 image is 1,024 patches and
# 256 prompt tokens, as for Qwen2-VL-2B, while every kernel is small. A job's rate on it is what its host
# allows (input, scheduling, launches) at a real workload's shapes; for GPU benchmarks.
SIZES["thin"] = replace(SIZES["tiny"], merged_patches=SIZES["2b"].merged_patches)
# The tiny model's widths at Qwen2-VL-2B's depth (28 decoder layers, 32 vision blocks): every kernel small, so
# that on a CPU a step's time is mostly the host's work of running its layers, what a GPU's host spends
# launching them; for host benchmarks.
SIZES["deep"] = replace(SIZES["tiny"], num_layers=SIZES["2b"].num_layers, vit_depth=SIZES["2b"].vit_depth)


def _decoder_widths(spec: TinySize, vocab_size: int) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
    }


def _qwen_text_config(spec: TinySize, vocab_size: int, ids: dict[str, int], interleaved: bool) -> dict:
    return {
        **_decoder_widths(spec, vocab_size),
        "head_dim": spec.head_dim,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": spec.mrope_section(interleaved),
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def _qwen_vision_config(family: str, spec: TinySize) -> dict:
    common = {"depth": spec.vit_depth, "num_heads": spec.vit_heads, "spatial_merge_size": 2}
    common["temporal_patch_size"] = 2
    if family == "qwen2_vl":
        return {**common, "embed_dim": spec.vit_dim, "hidden_size": spec.hidden_size, "patch_size": 14}
    wide = {
        **common,
        "hidden_size": spec.vit_dim,
        "intermediate_size": spec.vit_mlp_size,
        "out_hidden_size": spec.hidden_size,
    }
    if family == "qwen2_5_vl":
        # Window attention in every block but the odd ones; windows of 2x2 merged patches (tiny images
        # span several windows, so the windowed blocks really see several).
        return {
            **wide,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": list(range(1, spec.vit_depth, 2)),
            "tokens_per_second": 2,
        }
    return {  # qwen3_vl
        **wide,
        "patch_size": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "num_position_embeddings": 64,  # a square: an 8x8 learned grid, interpolated
        "deepstack_visual_indexes": list(range(min(spec.vit_depth, spec.num_layers))),
    }


def sharpen_attention(model, factor: float) -> None:
    """Scale every attention's query and key projections by `factor` (scores by its square).

    Random weights give nearly uniform attention, so positions and masks barely move the logits and a
    wrong position can pass a parity test; sharp attention makes such mistakes change the tokens. Applies
    to separate `q_proj`/`k_proj` layers and to fused `qkv` layers (query and key thirds)."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj") and hasattr(module, "k_proj"):
                for layer in (module.q_proj, module.k_proj):
                    layer.weight.mul_(factor)
                    if layer.bias is not None:
                        layer.bias.mul_(factor)
            elif isinstance(getattr(module, "qkv", None), torch.nn.Linear):
                rows = 2 * module.qkv.out_features // 3
                module.qkv.weight[:rows].mul_(factor)
                if module.qkv.bias is not None:
                    module.qkv.bias[:rows].mul_(factor)


def _save_model(
    model_class, config, seed: int, out: Path, eos: int | list[int], pad: int, bos: int, sharpness: float
) -> None:
    """Seeded random weights (attention sharpened by `sharpness`), the generation config `generate` reads
    its special tokens from, saved."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config).eval()
    if sharpness != 1.0:
        sharpen_attention(model, sharpness)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = bos
    model.save_pretrained(out)


@dataclass
class QwenParts:
    """What a Qwen-VL checkpoint is made of besides its weights."""

    config: object
    model_class: type
    processor: object
    eos: list[int]
    endoftext: int


def qwen_parts(family: str, spec: TinySize, seed: int) -> QwenParts:
    """The config, model class, and processor (tokenizer, image processor, chat template) of a checkpoint of
    `family` at `spec`'s sizes."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    from batchvl.models.processor import IMAGE_ONLY_PROCESSORS

    config_class, model_class = {
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
    }[family]
    is_qwen3 = family == "qwen3_vl"
    template = chat_templates.QWEN3_VL if is_qwen3 else chat_templates.QWEN2_VL
    tokenizer = build_qwen_tokenizer(spec.tokenizer_vocab or spec.vocab_size, seed, template)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    vocab_size = max(spec.vocab_size, len(tokenizer))
    config = config_class(
        text_config=_qwen_text_config(spec, vocab_size, ids, interleaved=is_qwen3),
        vision_config=_qwen_vision_config(family, spec),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tied_embeddings,
    )
    merged = (32 if is_qwen3 else 28) ** 2  # pixels of one merged patch
    normalization = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if is_qwen3 else {}
    image_processor = Qwen2VLImageProcessorPil(
        size={
            "shortest_edge": merged * spec.merged_patches[0],
            "longest_edge": merged * spec.merged_patches[1],
        },
        patch_size=16 if is_qwen3 else 14,
        merge_size=2,
        temporal_patch_size=2,
        **normalization,
    )
    processor = IMAGE_ONLY_PROCESSORS[family](
        image_processor=image_processor, tokenizer=tokenizer, chat_template=template
    )
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    return QwenParts(config, model_class, processor, eos, ids["<|endoftext|>"])


def _build_qwen(out: Path, family: str, spec: TinySize, seed: int, sharpness: float) -> None:
    parts = qwen_parts(family, spec, seed)
    endoftext = parts.endoftext
    _save_model(parts.model_class, parts.config, seed, out, parts.eos, endoftext, endoftext, sharpness)
    parts.processor.save_pretrained(out)


def _build_llava(out: Path, spec: TinySize, seed: int, sharpness: float) -> None:
    """LLaVA-1.5 layout: CLIP vision (layer -2, CLS dropped), a 2-layer projector, a Llama decoder."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = build_llama_tokenizer(spec.vocab_size, seed, chat_templates.LLAVA)
    pad_id = tokenizer.convert_tokens_to_ids("<pad>")
    side, patch = spec.clip_image_size, 14
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": spec.vit_dim,
            "intermediate_size": spec.vit_mlp_size,
            "num_hidden_layers": spec.vit_depth + 1,  # the last layer is computed but not used (layer -2)
            "num_attention_heads": spec.vit_heads,
            "image_size": side,
            "patch_size": patch,
            "projection_dim": spec.vit_dim,
            "hidden_act": "quick_gelu",
        },
        text_config=_llama_text_config(
            spec,
            len(tokenizer),
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            pad_id,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=(side // patch) ** 2,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    _save_model(
        LlavaForConditionalGeneration,
        config,
        seed,
        out,
        tokenizer.eos_token_id,
        pad_id,
        tokenizer.bos_token_id,
        sharpness,
    )
    # llava-hf's LLaVA-1.5 checkpoints use the CLIP image processor: shortest edge, centre crop, no padding.
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=chat_templates.LLAVA,
        num_additional_image_tokens=1,  # CLIP's CLS; the "default" strategy drops it again
    ).save_pretrained(out)


def _build_idefics3(out: Path, spec: TinySize, seed: int, sharpness: float) -> None:
    """Idefics3 layout: SigLIP-like tiles, a pixel-shuffle connector (scale 2), a Llama decoder. An image
    is resized to 4 tiles on its longest edge (as the real 1456 / 364), so it becomes up to 4x4 tiles plus
    a global view."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor

    from batchvl.models.processor import Idefics3ImageProcessorPil

    tokenizer = build_idefics3_tokenizer(spec.vocab_size, seed, chat_templates.IDEFICS3)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}
    tile, patch, scale = spec.tile_size, 14, 2
    bos, eos, pad = ids["<|begin_of_text|>"], ids["<end_of_utterance>"], ids["<|finetune_right_pad_id|>"]
    config = Idefics3Config(
        vision_config=_tile_tower_config(spec, tile, patch),
        text_config=_llama_text_config(spec, len(tokenizer), bos, eos, pad),
        scale_factor=scale,
        image_token_id=ids["<image>"],
        pad_token_id=pad,
    )
    _save_model(
        Idefics3ForConditionalGeneration,
        config,
        seed,
        out,
        [eos, ids["<|end_of_text|>"]],
        pad,
        bos,
        sharpness,
    )
    _save_tiled_processor(
        Idefics3Processor,
        Idefics3ImageProcessorPil,
        tokenizer,
        (tile, patch, scale),
        chat_templates.IDEFICS3,
        out,
    )


def _build_smolvlm(out: Path, spec: TinySize, seed: int, sharpness: float) -> None:
    """SmolVLM2-256M's and -500M's layout: Idefics3's with 16-pixel patches and a pixel shuffle of scale 4
    (a 512-pixel tile's 1,024 patches become 64 image tokens), SmolLM2-style text. The test sizes (tiny,
    thin) have a 128-pixel tile (4 tokens), the others the real 512. An image is resized to 4 tiles on its
    longest edge, as Idefics3's."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    from batchvl.models.processor import SmolVLMImageOnlyProcessor, SmolVLMImageProcessorPil

    tokenizer = build_smolvlm_tokenizer(spec.tokenizer_vocab or spec.vocab_size, seed, chat_templates.SMOLVLM)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}
    tile, patch, scale = (128 if spec.tile_size < 128 else 512), 16, 4
    bos, eos, pad = ids["<|im_start|>"], ids["<end_of_utterance>"], ids["<|im_end|>"]
    config = SmolVLMConfig(
        vision_config=_tile_tower_config(spec, tile, patch),
        text_config=_llama_text_config(
            spec, max(spec.vocab_size, len(tokenizer)), bos, eos, pad, rope_theta=100000.0
        ),
        scale_factor=scale,
        image_token_id=ids["<image>"],
        pad_token_id=pad,
        tie_word_embeddings=spec.tied_embeddings,
    )
    _save_model(SmolVLMForConditionalGeneration, config, seed, out, eos, pad, bos, sharpness)
    _save_tiled_processor(
        SmolVLMImageOnlyProcessor,
        SmolVLMImageProcessorPil,
        tokenizer,
        (tile, patch, scale),
        chat_templates.SMOLVLM,
        out,
        # as SmolVLM2's checkpoints: 1 frame a second, at most 64, each the size of a tile
        video_sampling={"fps": 1, "max_frames": 64, "video_size": {"longest_edge": tile}},
    )


def _build_internvl(out: Path, spec: TinySize, seed: int, sharpness: float) -> None:
    """InternVL3's layout (the transformers-format checkpoints): an InternViT tower over square tiles of
    14-pixel patches, CLS dropped, a pixel shuffle of 0.5 and a 2-layer projector, Qwen2.5-style text. The
    tile is the CLIP crop's side (448 in the real ones); an image becomes up to 12 tiles plus a thumbnail."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from batchvl.models.processor import GotOcr2ImageProcessorPil, InternVLImageOnlyProcessor

    named = INTERNVL_IMAGE_TOKENS
    tokenizer = build_qwen_tokenizer(
        spec.tokenizer_vocab or spec.vocab_size, seed, chat_templates.INTERNVL, named
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}
    tile, patch = spec.clip_image_size, 14
    config = InternVLConfig(
        vision_config={
            "hidden_size": spec.vit_dim,
            "intermediate_size": spec.vit_mlp_size,
            "num_hidden_layers": spec.vit_depth,
            "num_attention_heads": spec.vit_heads,
            "image_size": [tile, tile],
            "patch_size": [patch, patch],
            "use_absolute_position_embeddings": True,
        },
        text_config={
            "model_type": "qwen2",
            **_decoder_widths(spec, max(spec.vocab_size, len(tokenizer))),
            "max_position_embeddings": 8192,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        image_token_id=ids[named["context_image_token"]],
        downsample_ratio=0.5,
    )
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    _save_model(InternVLForConditionalGeneration, config, seed, out, eos, pad, pad, sharpness)
    # as the published checkpoints: crop_to_patches saved false, which the processor's call overrides
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile},
        crop_to_patches=False,
        min_patches=1,
        max_patches=12,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    InternVLImageOnlyProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=(tile // patch) ** 2 // 4,
        chat_template=chat_templates.INTERNVL,
    ).save_pretrained(out)


def _tile_tower_config(spec: TinySize, tile: int, patch: int) -> dict:
    """The SigLIP-style tower of the tiled families, one tile a call."""
    return {
        "hidden_size": spec.vit_dim,
        "intermediate_size": spec.vit_mlp_size,
        "num_hidden_layers": spec.vit_depth,
        "num_attention_heads": spec.vit_heads,
        "image_size": tile,
        "patch_size": patch,
    }


def _llama_text_config(spec: TinySize, vocab_size: int, bos: int, eos: int, pad: int, **extra) -> dict:
    return {
        "model_type": "llama",
        **_decoder_widths(spec, vocab_size),
        "max_position_embeddings": 8192,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        **extra,
    }


def _save_tiled_processor(
    processor_class, image_processor_class, tokenizer, tiling, chat_template, out: Path, **image_settings
):
    """An image is resized to 4 tiles on its longest edge; each tile's patches, pixel-shuffled by `scale`,
    fill `image_seq_len` tokens."""
    tile, patch, scale = tiling
    image_processor = image_processor_class(
        size={"longest_edge": 4 * tile}, max_image_size={"longest_edge": tile}, **image_settings
    )
    processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=(tile // patch) ** 2 // scale**2,
        chat_template=chat_template,
    ).save_pretrained(out)


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "idefics3", "smolvlm", "internvl")


def build_tiny_model(
    out_dir: str | Path, family: str = "qwen2_vl", size: str = "tiny", seed: int = 0, sharpness: float = 1.0
) -> Path:
    """Write a random-weight checkpoint (model, tokenizer, image processor, chat template) to out_dir.
    `sharpness` scales attention queries and keys (see `sharpen_attention`): tests use it so that their
    model's outputs depend on positions."""
    if family not in FAMILIES:
        raise UserError(f"unknown family '{family}'; supported: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise UserError(f"unknown size '{size}'; supported: {', '.join(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if family == "llava":
        _build_llava(out, SIZES[size], seed, sharpness)
    elif family == "idefics3":
        _build_idefics3(out, SIZES[size], seed, sharpness)
    elif family == "smolvlm":
        _build_smolvlm(out, SIZES[size], seed, sharpness)
    elif family == "internvl":
        _build_internvl(out, SIZES[size], seed, sharpness)
    else:
        _build_qwen(out, family, SIZES[size], seed, sharpness)
    return out
