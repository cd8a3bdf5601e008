"""The step's sequences and tokens and the vision call's patches: as given, or with `auto` the CPU's on the
CPU and, on CUDA, 1,024 sequences on a GPU of 70 GiB or more and the largest sizes that fit a tenth of the
free memory; the GPU's memory and the measured step are faked."""

import torch

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.scheduling.kv_budget import kv_cache_bytes, vision_reserve_bytes
from batchvl.engine.scheduling.step_sizes import resolved_step_sizes
from batchvl.utils.memory import GB, MB

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")


class Measured:
    """A step measurement reporting `mib` at any size, recording the configs it was asked to run."""

    def __init__(self, mib: float):
        self.mib, self.asked = mib, []

    def __call__(self, config: EngineConfig) -> int:
        self.asked.append(config)
        return int(self.mib * MB)


def resolved(config: EngineConfig, device, peak: Measured, free_gb: float, total_gb: float = 141):
    return resolved_step_sizes(config, device, peak, lambda: int(free_gb * GB), lambda: int(total_gb * GB))


def sizes(config: EngineConfig, device, peak: Measured, free_gb: float) -> tuple[int, int]:
    chosen = resolved(config, device, peak, free_gb)
    return chosen.max_num_batched_tokens, chosen.max_patches_per_encode


def test_auto_sequences_are_vllms_for_a_large_gpu_and_256_elsewhere():
    peak = Measured(450)
    assert resolved(EngineConfig(), GPU, peak, free_gb=130, total_gb=139.8).max_num_seqs == 1024  # an H200
    assert resolved(EngineConfig(), GPU, peak, free_gb=70, total_gb=79.2).max_num_seqs == 1024  # an H100
    # the step measured to choose the token budget has the CPU's sequences: its scaled logits still bound
    # a 16,384-token step's 1,024 rows
    assert {config.max_num_seqs for config in peak.asked} == {256}
    an_l4 = resolved(EngineConfig(), GPU, Measured(450), free_gb=20, total_gb=23.6)
    assert an_l4.max_num_seqs == 256
    assert resolved(EngineConfig(), CPU, Measured(450), free_gb=0, total_gb=0).max_num_seqs == 256


def test_given_sequences_are_kept_and_the_gpu_is_not_asked_its_size():
    def never() -> int:
        raise AssertionError("the GPU's total memory was asked for")

    config = EngineConfig(max_num_seqs=48)
    chosen = resolved_step_sizes(config, GPU, Measured(450), lambda: int(130 * GB), never)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (48, 16384)


def test_auto_on_a_large_gpu_takes_the_largest_sizes():
    # Qwen2-VL-2B on an H200: some 130 GiB free; 450 MiB for a step of 2,048 tokens, so 16,384 take 3.5 GiB
    peak = Measured(450)
    assert sizes(EngineConfig(), GPU, peak, free_gb=130) == (16384, 32768)
    assert [(c.max_num_batched_tokens, c.max_patches_per_encode) for c in peak.asked] == [(2048, 4096)]


def test_auto_on_a_smaller_gpu_takes_what_fits_a_tenth_of_its_free_memory():
    # a tenth of 20 GiB is 2,048 MiB: 16,384 tokens at 900 MiB a 2,048 would be 7,200 MiB, 8,192 tokens
    # 3,600, 4,096 tokens 1,800; patches: 16,384 have a bound of 2,048 MiB, 32,768 twice that
    assert sizes(EngineConfig(), GPU, Measured(900), free_gb=20) == (4096, 16384)
    # a tenth of 2 GiB is 204.8 MiB: no GPU size fits, the CPU's are kept
    assert sizes(EngineConfig(), GPU, Measured(900), free_gb=2) == (2048, 4096)


def test_auto_on_the_cpu_and_given_sizes_anywhere_are_kept_and_nothing_is_measured():
    peak = Measured(450)
    assert sizes(EngineConfig(), CPU, peak, free_gb=130) == (2048, 4096)
    given = EngineConfig(max_num_batched_tokens=512, max_patches_per_encode=1024)
    assert sizes(given, GPU, peak, free_gb=130) == (512, 1024)
    assert peak.asked == []
    # one given, the other auto: the given one stays, the other is chosen
    assert sizes(EngineConfig(max_num_batched_tokens=512), GPU, peak, free_gb=130) == (512, 32768)
    assert sizes(EngineConfig(max_patches_per_encode=1024), GPU, Measured(450), free_gb=130) == (16384, 1024)


def test_a_larger_vision_call_keeps_more_memory_out_of_the_kv_cache(monkeypatch):
    assert vision_reserve_bytes(4096) == vision_reserve_bytes(1024) == 512 * MB
    assert vision_reserve_bytes(32768) == 4096 * MB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60_000 * MB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    config = EngineConfig(max_num_batched_tokens=16384, max_patches_per_encode=32768, encoder_cache_mb=0)
    assert kv_cache_bytes(config, GPU, lambda: 0) == int((60_000 - 4096) * MB * 0.9)


def test_an_engine_on_the_cpu_runs_the_cpus_sizes(loaded_fp32):
    engine = Engine(loaded_fp32.adapter, loaded_fp32.processor.tokenizer, EngineConfig(kv_cache_mb=8), [0])
    assert (engine.config.max_num_batched_tokens, engine.config.max_patches_per_encode) == (2048, 4096)
    assert engine.scheduler.max_num_batched_tokens == 2048
    assert engine.config.max_num_seqs == engine.scheduler.max_num_seqs == 256
