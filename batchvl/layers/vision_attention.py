"""Vision-tower attention over many images in ONE call per layer (images never attend to each other).

transformers hands a vision attention function the packed patches of all images plus `cu_seqlens` only
when the implementation's name contains "flash"; under that name this function runs:
- flash-attn's varlen kernel on CUDA when the package is installed, else torch's own flash varlen kernel
  (`torch_flash_varlen`), in fp16 or bf16 on Ampere or newer (elsewhere, once it has failed, or where
  `engine.vision_attention` is `sdpa` (`VARLEN_ATTRIBUTE` off on the calling module), the SDPA path below);
- in bf16 on a CPU with bf16 dot products, batchvl's native kernel, all sequences in one call
  (`cpu_attention.native_attention`);
- otherwise attention on slices of the packed rows: consecutive sequences of equal length (images of one
  size, a video's frame groups) go through one batched call, every other sequence through a call of
  its own. Slices and equal-length batches are views of the packed layout: nothing is copied or
  padded, and no key is masked. (Padding neighbours of similar length into one masked call measured
  about 10% slower: the padded scores and the copies in and out cost more than the calls saved.)
  Each call is torch's SDPA in float32, and `cpu_attention.blocked_attention` in bf16 on CPU. Under
  `engine.vision_attention: sdpa`, on CUDA SDPA is asked for cuDNN's kernel first (`CUDA_SDPA_ORDER`),
  then its FlashAttention-2, memory-efficient and math ones, each where it takes the inputs: torch would
  try cuDNN's last.

The linear layers around the attention see every image of the call at once, whatever their sizes: one
vision forward per encode call instead of one per size class.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchvl.layers.cpu_attention import (
    blocked_attention,
    native_attention,
    use_blocked_attention,
    use_native_attention,
)
from batchvl.layers.torch_flash_varlen import torch_varlen_function

VISION_ATTENTION_NAME = "batchvl_flash_varlen"  # "flash" in the name makes transformers pass cu_seqlens
BATCHED_VISION_ATTENTION_NAME = "batchvl_vision"  # towers that attend (B, H, N, D) batches of one size

logger = logging.getLogger(__name__)


# A module attribute: where it is False (`engine.vision_attention: sdpa`), the tower's calls skip the flash
# varlen kernel for the SDPA path
VARLEN_ATTRIBUTE = "flash_varlen"
CUDA_SDPA_ORDER = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn raises RuntimeError for any other
_flash_refusals: list[str] = []  # why flash-attn failed in this process, once: SDPA from then on


@functools.cache
def _flash_varlen_func():
    """flash-attn's varlen function, or None without the package: imported once per process, where a
    failed import searched sys.path again in every layer of every vision call."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _varlen_kernel() -> tuple[str, object] | None:
    """(name, function) of the varlen kernel for CUDA: flash-attn's where installed, else torch's own."""
    flash = _flash_varlen_func()
    if flash is not None:
        return "flash-attn", flash
    own = torch_varlen_function()
    return ("torch's flash varlen attention", own) if own is not None else None


@functools.cache
def _ampere_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 8


def flash_varlen_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the varlen kernel runs a vision call in `dtype` on `device`: on CUDA only. Its known refusals
    (fp32, GPUs before Ampere) are checked before the call instead of raised in every layer; fp32 vision
    towers then run SDPA as without it."""
    return (
        device.type == "cuda"
        and not _flash_refusals
        and dtype in FLASH_DTYPES
        and _varlen_kernel() is not None
        and _ampere_or_newer(device)
    )


def _flash_varlen(query, key, value, cu_seqlens, max_length, scaling):
    # (1, H, T, D) -> (T, H, D)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    cu = cu_seqlens.to(torch.int32)
    _, kernel = _varlen_kernel()
    out = kernel(q, k, v, cu, cu, max_length, max_length, softmax_scale=scaling)
    return out[None]


def capturing(query: torch.Tensor) -> bool:
    """Whether the call runs in a CUDA graph's capture (`qwen_vision_graphs`)."""
    return query.is_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def equal_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive sequences of the same length."""
    runs = []
    first = 0
    while first < len(lengths):
        end = first + 1
        while end < len(lengths) and lengths[end] == lengths[first]:
            end += 1
        runs.append((first, end - first))
        first = end
    return runs


def _run_attention(query, key, value, count: int, scaling, cudnn_first: bool = False):
    """`count` equal-length sequences packed in (1, H, T, D) views -> (1, T, H, D). Splitting T into
    (count, length) is a view of the packed layout, so the batch needs neither a copy nor a mask."""
    _, heads, total, head_dim = query.shape
    q, k, v = (
        t[0].reshape(heads, count, total // count, head_dim).transpose(0, 1) for t in (query, key, value)
    )
    if use_blocked_attention(q):
        return blocked_attention(q, k, v, scaling).reshape(1, total, heads, head_dim)
    with sdpa_kernel(CUDA_SDPA_ORDER, set_priority=True) if cudnn_first else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)
    return out.transpose(1, 2).reshape(1, total, heads, head_dim)


def _attention_per_run(query, key, value, lengths: list[int], scaling, cudnn_first: bool = False):
    """Each run of equal-length sequences in one call; with `cudnn_first` (CUDA, `engine.vision_attention:
    sdpa`), SDPA asked for its backends in `CUDA_SDPA_ORDER`, else left to torch's own order."""
    runs = equal_runs(lengths)
    if len(runs) == 1:
        return _run_attention(query, key, value, len(lengths), scaling, cudnn_first)
    _, heads, total, head_dim = query.shape
    out = query.new_empty((1, total, heads, head_dim))
    start = 0
    for first, count in runs:
        rows = slice(start, start + lengths[first] * count)
        q, k, v = (t[:, :, rows] for t in (query, key, value))
        out[:, rows] = _run_attention(q, k, v, count, scaling, cudnn_first)
        start = rows.stop
    return out


# The packed sequences' lengths of the last vision calls, by their cu_seqlens tensor: every layer of a
# call gets the same tensor (Qwen2.5-VL's towers alternate two, windows and whole images), and reading it
# from a GPU waits for all the work queued before it, a sync in every layer. The tensors are held, so an
# identity match is never a new tensor at a freed one's address. One list per thread: engine replicas
# encode side by side, each its own call.
class _LengthsRead(threading.local):
    def __init__(self):
        self.entries: list[tuple[torch.Tensor, list[int]]] = []


_lengths_read = _LengthsRead()
LENGTHS_KEPT = 2


def sequence_lengths(cu_seq_lens: torch.Tensor) -> list[int]:
    for tensor, lengths in _lengths_read.entries:
        if tensor is cu_seq_lens:
            return lengths
    lengths = (cu_seq_lens[1:] - cu_seq_lens[:-1]).tolist()
    remember_lengths(cu_seq_lens, lengths)
    return lengths


def remember_lengths(cu_seq_lens: torch.Tensor, lengths: list[int]) -> None:
    """Give `sequence_lengths` the lengths of `cu_seq_lens`, known on the host where the call's inputs
    were made (`models/qwen_vision_inputs.py`), so that no layer reads them back."""
    entries = _lengths_read.entries
    entries.insert(0, (cu_seq_lens, lengths))
    del entries[LENGTHS_KEPT:]


def varlen_vision_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """q/k/v (1, H, T, D) packed over sequences given by cu_seq_lens_q; returns (1, T, H, D).
    `max_length_q`, where given, bounds the sequences' lengths for the varlen kernel, which then reads
    nothing of them on the host: a vision call replayed as a graph (`qwen_vision_graphs`) passes its shape's
    bound, and sequences of no rows pad its count."""
    if cu_seq_lens_q is None:
        raise RuntimeError("varlen vision attention needs cu_seqlens (use it for vision_config only)")
    varlen = getattr(module, VARLEN_ATTRIBUTE, True)
    if varlen and flash_varlen_runs(query.dtype, query.device):
        longest = max_length_q if max_length_q is not None else max(sequence_lengths(cu_seq_lens_q))
        try:
            return _flash_varlen(query, key, value, cu_seq_lens_q, longest, scaling), None
        except torch.OutOfMemoryError:
            raise  # SDPA would need more memory, not less
        except (RuntimeError, TypeError) as exc:
            if capturing(query):
                raise  # a graph's capture failing (its caller runs the call eagerly), not the kernel
            # A refusal not checked above (a head size, a build for other GPUs, a signature of another
            # torch release): said once, and SDPA
            # below from now on instead of the same failure in every layer.
            _flash_refusals.append(str(exc))
            name, _ = _varlen_kernel()
            logger.warning("%s failed on the vision tower (%s); using torch's SDPA instead", name, exc)
    if use_native_attention(query):
        # (1, H, T, D) views of (T, H, D) rows: the kernel reads and writes the rows' own layout
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return native_attention(q, k, v, cu_seq_lens_q, scaling)[None], None
    lengths = sequence_lengths(cu_seq_lens_q)
    return _attention_per_run(query, key, value, lengths, scaling, query.is_cuda and not varlen), None


def batched_vision_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A batch of images of one size, (B, H, N, D), as the CLIP and SigLIP towers (LLaVA, Idefics3) call
    attention; returns (B, N, H, D). Unmasked and non-causal, in bf16 on a CPU with bf16 dot products: the
    images as packed sequences of the native kernel. Otherwise (a patch mask, fp32, other CPUs):
    transformers' SDPA function, what these towers ran before."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    if attention_mask is None and not causal and use_native_attention(query):
        batch, heads, length, dim = query.shape
        # (B, H, N, D) views of (B, N, H, D) projections: as packed (B * N, H, D) rows, a view again
        q, k, v = (t.transpose(1, 2).reshape(batch * length, heads, dim) for t in (query, key, value))
        cu_seqlens = torch.arange(0, batch * length + 1, length)
        return native_attention(q, k, v, cu_seqlens, scaling).view(batch, length, heads, dim), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal, **kwargs
    )


def register_vision_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_ATTENTION_NAME, varlen_vision_attention)
    AttentionInterface.register(BATCHED_VISION_ATTENTION_NAME, batched_vision_attention)
