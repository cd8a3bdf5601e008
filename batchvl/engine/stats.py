"""The engine's counters. The engine counts what it does itself; `Engine.stats` adds the counters its
components own (the runner's forward time, the scheduler's preemptions and prefix hits, the encoder
cache's evictions, the grammar work of constrained requests) instead of copying them each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchvl.utils.stats import Counters


@dataclass
class EngineStats(Counters):
    images_total: int = 0
    images_encoded: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_evictions: int = 0
    encoder_disk_hits: int = 0  # images whose embedding was read from engine.encoder_cache_dir
    encoder_disk_writes: int = 0
    encoder_disk_s: float = 0.0  # reading and writing the disk cache's entries
    patches_encoded: int = 0
    patches_encoded_per_rank: list[int] = field(default_factory=list)  # under ViT data parallelism
    encode_s: float = 0.0
    forward_s: float = 0.0  # in the language model's packed forward (with logits)
    grammar_s: float = 0.0  # constrained decoding: compiling grammars, filling and applying token masks
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache, not computed
    steps: int = 0
    preemptions: int = 0
