"""Admitting a request: where its media's placeholder tokens are, and whether it can ever run.

A request that fails here comes back at once as an error result (a `SampleError`) instead of stalling the
scheduler or failing the job: placeholders that do not match its media, a prompt longer than the model's
context, a request larger than the whole KV cache, or an image one step can never hold.
"""

from __future__ import annotations

import numpy as np

from batchvl.config import EngineConfig
from batchvl.engine.request import MediaSpan
from batchvl.errors import SampleError
from batchvl.preprocess.media import PreparedMedia


def media_spans(
    prompt_token_ids: list[int], media: list[PreparedMedia], placeholder_token_ids: dict[str, int]
) -> list[MediaSpan]:
    """Each image (or video) takes the next `num_tokens` placeholder tokens of its kind, in prompt order;
    they form one run or several (tiles, frames), each filled by the next rows of its embedding. Kinds that
    share a token (SmolVLM's video frames are image tokens) take that token's placeholders in turn."""
    ids = np.asarray(prompt_token_ids)
    placeholders = {kind: np.flatnonzero(ids == token) for kind, token in placeholder_token_ids.items()}
    taken = dict.fromkeys(placeholder_token_ids.values(), 0)
    none = np.empty(0, dtype=np.int64)  # a kind the model has no placeholder for
    spans = []
    for item in media:
        token = placeholder_token_ids.get(item.kind)
        first = taken.get(token, 0)
        positions = placeholders.get(item.kind, none)[first : first + item.num_tokens]
        if len(positions) < item.num_tokens:
            raise _placeholder_mismatch(media, placeholders)
        taken[token] = first + item.num_tokens
        run_starts = np.flatnonzero(np.diff(positions, prepend=-2) != 1)
        run_ends = np.append(run_starts[1:], len(positions))
        spans += [
            MediaSpan(int(positions[lo]), int(hi - lo), item.content_hash, int(lo))
            for lo, hi in zip(run_starts, run_ends, strict=True)
        ]
    if any(taken[placeholder_token_ids[kind]] != len(found) for kind, found in placeholders.items()):
        raise _placeholder_mismatch(media, placeholders)
    return sorted(spans, key=lambda span: span.offset)


def _placeholder_mismatch(media: list[PreparedMedia], placeholders: dict[str, np.ndarray]) -> SampleError:
    found = {kind: len(positions) for kind, positions in placeholders.items()}
    wanted = [(item.kind, item.num_tokens) for item in media]
    return SampleError(
        "prompt_mismatch", f"prompt has placeholder tokens {found} for media (kind, tokens) {wanted}"
    )


def check_fits(
    num_prompt_tokens: int,
    max_new_tokens: int,
    spans: list[MediaSpan],
    *,
    max_model_len: int,
    kv_capacity_tokens: int,
    config: EngineConfig,
) -> None:
    """Raise a `SampleError` when the request could never be scheduled."""
    if num_prompt_tokens >= max_model_len:
        raise SampleError(
            "context_too_long",
            f"prompt has {num_prompt_tokens} tokens with its images but the model's context is "
            f"{max_model_len}; lower preprocess.max_pixels or shorten the prompt",
        )
    needed = min(num_prompt_tokens + max_new_tokens, max_model_len)
    if needed > kv_capacity_tokens:
        raise SampleError(
            "kv_cache_too_small",
            f"request needs {needed} tokens of KV cache but engine.kv_cache_mb holds "
            f"{kv_capacity_tokens} tokens; raise engine.kv_cache_mb",
        )
    budget = config.max_num_batched_tokens
    largest = max((span.length for span in spans), default=0)
    if config.disable_chunked_mm_input and largest > budget:
        raise SampleError(
            "image_exceeds_chunk",
            f"an image takes {largest} tokens, more than one step's "
            f"engine.max_num_batched_tokens={budget}, and engine.disable_chunked_mm_input keeps an image "
            "in one chunk; raise max_num_batched_tokens or lower preprocess.max_pixels",
        )
