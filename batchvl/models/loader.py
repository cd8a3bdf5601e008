"""Load a checkpoint folder into (adapter, processor), safely and offline-friendly.

Safe by default: `trust_remote_code` is off unless the job sets it, and weights must be safetensors, so
nothing untrusted is unpickled.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch

from batchvl.engine.device.placement import resolve_device
from batchvl.engine.fast_paths import fast_path_on
from batchvl.errors import UserError
from batchvl.models.adapter import VLMAdapter
from batchvl.models.checkpoint_folder import check_model_folder
from batchvl.models.registry import ModelFamily, model_family
from batchvl.utils.versions import check_library_versions

logger = logging.getLogger(__name__)
PIL_BACKEND = "pil"  # transformers' name for its Pillow image processors (load_processor)


@dataclass
class LoadedModel:
    adapter: VLMAdapter
    processor: object  # a Hugging Face processor: .tokenizer, .image_processor, .apply_chat_template
    family: ModelFamily
    path: str

    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids as `generate` would use them: the generation config's, else the tokenizer's."""
        generation_config = getattr(self.adapter.model, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.processor.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])


@dataclass
class ModelParts:
    """What a job's preprocessing needs of its model, read without the weights: the processor, the family,
    the model's config, and the dtype and device the weights will have. A job's workers are forked once
    these are read and before the weights are (`pipeline/launch.py`): a fork copies the page tables of the
    process's memory, some 18 ms per GB of it on a 2-core AMD EPYC, and the workers prepare the first
    samples while the weights load."""

    processor: object
    family: ModelFamily
    config: object  # the model's transformers config
    dtype: torch.dtype
    device: torch.device
    path: str

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelParts:
        """The parts of a model loaded already."""
        adapter = loaded.adapter
        return cls(
            loaded.processor, loaded.family, adapter.model.config, adapter.dtype, adapter.device, loaded.path
        )


def load_model_parts(
    path: str, dtype: str = "auto", device: str | torch.device = "auto", trust_remote_code: bool = False
) -> ModelParts:
    """The checkpoint's `ModelParts`, its weights left unread."""
    check_library_versions()  # the Python API's way in: before the model's files are read
    config = check_model_folder(path, trust_remote_code)
    family = model_family(config.model_type)
    torch_device = device if isinstance(device, torch.device) else resolve_device(device)
    return ModelParts(
        processor=load_processor(path, family.model_type, trust_remote_code),
        family=family,
        config=config,
        dtype=resolve_dtype(dtype, torch_device),
        device=torch_device,
        path=path,
    )


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        if device.type == "cpu" and not cpu_has_native_bf16():
            warn_slow_bf16()
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """bf16 matmuls are fast only on CPUs with AVX-512 (bf16) or AMX; elsewhere torch falls back to a
    reference kernel hundreds of times slower than fp32. (fp16 has no fast CPU path at all.)"""
    capability = torch.backends.cpu.get_cpu_capability()
    return "AVX512" in capability or "AMX" in capability


def warn_slow_bf16(size: int = 128) -> None:
    """Say once, with the cost measured on this CPU, that an explicit bfloat16 will be slow here."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, dtype=dtype)
        torch.matmul(a, a)  # warm-up
        started = time.perf_counter()
        torch.matmul(a, a)
        times[dtype] = time.perf_counter() - started
    slowdown = times[torch.bfloat16] / max(times[torch.float32], 1e-9)
    logger.warning(
        "model.dtype is bfloat16, but this CPU (%s) has no native bf16 matmul: a %dx%d bf16 matmul took "
        "%.0fx as long as fp32 here; use model.dtype: auto (fp32 on this CPU) or float32",
        torch.backends.cpu.get_cpu_capability(),
        size,
        size,
        slowdown,
    )


def load_processor(path: str, model_type: str, trust_remote_code: bool = False):
    """The checkpoint's processor; where torchvision is missing, an image-only one built from its parts."""
    from transformers import AutoProcessor, AutoTokenizer

    # AutoImageProcessor from its own module: some releases' top-level one needs torchvision (processor.py)
    from batchvl.models.processor import IMAGE_ONLY_PROCESSORS, AutoImageProcessor

    # batchvl's preprocessing reproduces transformers' Pillow image processors, so that backend is asked
    # for: where torchvision is installed, transformers would default to its torchvision backend, whose
    # resize rounds some pixels one level differently (about 0.6% of a Qwen image's values)
    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code, backend=PIL_BACKEND)
    except (ImportError, ValueError, OSError, TypeError) as exc:
        # Stock Qwen-VL and SmolVLM processors carry a video processor that needs torchvision (SmolVLM's
        # also num2words).
        if model_type not in IMAGE_ONLY_PROCESSORS:
            raise UserError(f"cannot load the processor of '{path}': {exc}") from exc
        logger.debug("AutoProcessor failed (%s); building an image-only processor", exc)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        image_processor = AutoImageProcessor.from_pretrained(
            path, trust_remote_code=trust_remote_code, backend=PIL_BACKEND
        )
        image_only = IMAGE_ONLY_PROCESSORS[model_type]
        settings = {"chat_template": tokenizer.chat_template, **saved_processor_settings(path, image_only)}
        return image_only(image_processor=image_processor, tokenizer=tokenizer, **settings)


def saved_processor_settings(path: str, processor_class: type) -> dict:
    """What a checkpoint saved for its processor that `processor_class` takes, its parts aside: the settings
    of `processor_config.json` (SmolVLM's `image_seq_len`, the image tokens a frame's features fill) and the
    processor's chat template (`chat_template.jinja`, or the older `chat_template.json`, which a tokenizer
    does not read)."""
    from transformers.processing_utils import ProcessorMixin

    saved, _ = ProcessorMixin.get_processor_dict(path)
    taken = inspect.signature(processor_class.__init__).parameters
    parts = {"self", "image_processor", "tokenizer"}
    return {
        key: value for key, value in saved.items() if key in taken and key not in parts and value is not None
    }


def load_model(
    path: str,
    dtype: str = "auto",
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
    fused_kernels: bool | str = False,
    vision_attention: str = "auto",
    parts: ModelParts | None = None,
) -> LoadedModel:
    """The model at `path`, its weights in `dtype` on `device`; `parts`: its parts read already (with those
    `dtype` and `device`), so that its processor is not read again."""
    from transformers import AutoModelForImageTextToText

    if parts is None:
        parts = load_model_parts(path, dtype, device, trust_remote_code)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=parts.dtype, trust_remote_code=trust_remote_code, use_safetensors=True
    )
    return prepared_model(
        model.to(parts.device),
        path,
        parts.family,
        parts.dtype,
        parts.device,
        trust_remote_code,
        fused_kernels,
        vision_attention,
        parts.processor,
    )


def prepared_model(
    model,
    path: str,
    family: ModelFamily,
    torch_dtype: torch.dtype,
    torch_device: torch.device,
    trust_remote_code: bool = False,
    fused_kernels: bool | str = False,
    vision_attention: str = "auto",
    processor: object | None = None,
) -> LoadedModel:
    """A model already in `torch_dtype` on `torch_device`, with batchvl's layer swaps and attention (with
    `fused_kernels` True or "auto", as `engine.fused_kernels` takes it, on CUDA, its elementwise passes as
    Triton kernels; a Qwen-VL tower's attention by `vision_attention`, as `engine.vision_attention` takes
    it), and the processor at `path` (`processor`, where it was read already). Apart
    from `load_model` so that a model made on its device (the GPU benchmarks' random weights) is handed
    over without a copy through the CPU."""
    from batchvl.layers.attention import PAGED_ATTENTION_NAME, register_paged_attention
    from batchvl.layers.fused_activation import fuse_mlp_activations
    from batchvl.layers.fused_kernels import use_fused_kernels
    from batchvl.layers.fused_projections import fuse_projections
    from batchvl.layers.packed_linear import pack_linear_weights
    from batchvl.layers.patch_embed import patch_convs_as_linear
    from batchvl.layers.qwen_vision_attention import use_own_vision_attention
    from batchvl.layers.rms_norm import use_native_rms_norms
    from batchvl.layers.vision_attention import (
        BATCHED_VISION_ATTENTION_NAME,
        VISION_ATTENTION_NAME,
        register_vision_attention,
    )

    if torch_device.type == "cuda" and torch_device.index is not None:
        # Triton's kernels launch on the current device, CUDA graphs capture on it: make it the model's
        # (outside torchrun, where each rank sets its own, it stays cuda:0 whatever model.device says; a
        # device without an index is the current one already)
        torch.cuda.set_device(torch_device)
    model.eval()
    patch_convs_as_linear(model)
    fuse_mlp_activations(model)
    fuse_projections(model)
    use_native_rms_norms(model)
    pack_linear_weights(model)
    if family.varlen_vision:
        use_own_vision_attention(model, flash_varlen=vision_attention != "sdpa")
    if fast_path_on(fused_kernels, torch_device) and torch_device.type == "cuda":
        # after the swaps above: the kernels go into the modules they made
        logger.info("fused kernels: %s", use_fused_kernels(model))
    register_paged_attention()
    register_vision_attention()
    # Text attention goes through the engine's paged KV cache; a varlen vision tower attends over all
    # images of an encode batch in one call per layer, another over its batch of equal-size images.
    model.set_attn_implementation(
        {
            "text_config": PAGED_ATTENTION_NAME,
            "vision_config": VISION_ATTENTION_NAME if family.varlen_vision else BATCHED_VISION_ATTENTION_NAME,
        }
    )
    logger.info("loaded %s (%s) on %s as %s", path, family.model_type, torch_device, torch_dtype)
    return LoadedModel(
        adapter=family.adapter(model, torch_dtype, torch_device),
        processor=processor
        if processor is not None
        else load_processor(path, family.model_type, trust_remote_code),
        family=family,
        path=path,
    )
