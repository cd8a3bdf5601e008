"""The KV cache's memory: `engine.kv_cache_mb` as given, or with `auto` 1024 MiB on the CPU and, on CUDA,
a share of what the GPU has free after the model, less the largest step's measured activations and a
reserve; the GPU's memory is faked, the largest step runs on the CPU."""

from types import SimpleNamespace

import pytest
import torch

from batchvl.config import EngineConfig, job_config_from_dict
from batchvl.engine.scheduling import activation_peak, kv_budget
from batchvl.engine.scheduling.activation_peak import largest_step, step_activation_peak
from batchvl.engine.scheduling.kv_budget import PEAK_HEADROOM, VISION_RESERVE_MB, kv_cache_bytes
from batchvl.errors import ConfigError, UserError
from batchvl.utils.memory import MB

GPU = torch.device("cuda", 1)
# the cache is sized after the engine has resolved the step sizes (`step_sizes`): their CPU values
SIZED = {"max_num_batched_tokens": 2048, "max_patches_per_encode": 4096}
# serial steps without decode graphs: one step's activations kept free (each fast path keeps one more)
EAGER = {"cuda_graphs": False, "overlap": False}


@pytest.fixture
def free_on_gpu(monkeypatch):
    """`free_on_gpu(mib)`: the GPU has that much free; returns the devices `mem_get_info` was asked about."""
    asked = []

    def have(mib: float) -> list:
        def mem_get_info(device):
            asked.append(device)
            return int(mib * MB), 80 * 1024 * MB

        monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        return asked

    return have


def measured(mib: float):
    """An activation measurement that reports `mib` and counts its calls."""

    def peak() -> int:
        peak.calls += 1
        return int(mib * MB)

    peak.calls = 0
    return peak


def test_auto_on_cuda_takes_a_share_of_the_memory_free_after_the_model_and_the_measured_step(free_on_gpu):
    asked = free_on_gpu(60_000)
    peak = measured(800)
    reserve = 800 * PEAK_HEADROOM + VISION_RESERVE_MB + 512  # and the default encoder cache
    assert kv_cache_bytes(EngineConfig(**SIZED, **EAGER), GPU, peak) == int((60_000 - reserve) * MB * 0.9)
    assert asked == [GPU]  # the model's GPU, not GPU 0
    assert peak.calls == 1
    config = EngineConfig(gpu_memory_utilization=0.5, encoder_cache_mb=0, **SIZED, **EAGER)
    reserve = 3_000 * PEAK_HEADROOM + VISION_RESERVE_MB  # a larger step keeps more free
    assert kv_cache_bytes(config, GPU, measured(3_000)) == int((60_000 - reserve) * MB * 0.5)


def test_each_fast_path_that_holds_memory_beside_a_step_keeps_one_more_step_free(free_on_gpu):
    """Decode graphs keep their own pool of a decode step's activations, overlapped steps the step in
    flight's outputs: each keeps the measured step's memory free once more (fused kernels hold none)."""
    free_on_gpu(60_000)
    fixed = VISION_RESERVE_MB + 512
    for options, steps in [
        ({"cuda_graphs": False, "overlap": False}, 1),
        ({"cuda_graphs": True, "overlap": False}, 2),
        ({"cuda_graphs": False, "overlap": True}, 2),
        ({"cuda_graphs": True, "overlap": True, "fused_kernels": True}, 3),
        ({}, 3),  # `auto`, on CUDA: both on
    ]:
        config = EngineConfig(**options, **SIZED)
        reserve = 800 * PEAK_HEADROOM * steps + fixed
        assert kv_cache_bytes(config, GPU, measured(800)) == int((60_000 - reserve) * MB * 0.9), options


def test_vision_graphs_keep_a_vision_calls_memory_free_once_more(free_on_gpu):
    """Their pool holds the largest graphed call's activations apart from eager calls' memory."""
    free_on_gpu(60_000)
    for options, calls in [({}, 1), ({"vision_graphs": False}, 1), ({"vision_graphs": True}, 2)]:
        config = EngineConfig(**options, **SIZED, **EAGER)
        reserve = 800 * PEAK_HEADROOM + VISION_RESERVE_MB * calls + 512
        assert kv_cache_bytes(config, GPU, measured(800)) == int((60_000 - reserve) * MB * 0.9), options


def test_auto_on_the_cpu_and_a_given_size_anywhere_are_what_they_were(free_on_gpu):
    asked = free_on_gpu(60_000)
    peak = measured(800)
    assert kv_cache_bytes(EngineConfig(), torch.device("cpu"), peak) == 1024 * MB
    assert kv_cache_bytes(EngineConfig(kv_cache_mb=300), GPU, peak) == 300 * MB
    assert kv_cache_bytes(EngineConfig(kv_cache_mb=0.5), torch.device("cpu"), peak) == MB // 2
    assert asked == [] and peak.calls == 0  # nothing measured where nothing depends on it


def test_a_gpu_without_room_for_the_cache_is_a_one_line_mistake(free_on_gpu):
    free_on_gpu(2000)  # less than the step's 1,250 MiB, the vision call's 512 and the encoder cache's 512
    with pytest.raises(UserError) as info:
        kv_cache_bytes(EngineConfig(**SIZED), GPU, measured(1000))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("engine.kv_cache_mb is auto, but cuda:1 has 2000 MiB free after the model")
    assert message.endswith("lower engine.max_num_batched_tokens or engine.encoder_cache_mb")


def test_the_largest_step_packs_the_token_budget_and_samples_a_row_per_sequence(loaded_fp32, monkeypatch):
    config = EngineConfig(max_num_batched_tokens=300, max_num_seqs=7, block_size=16)
    packed_rows = []
    forward = loaded_fp32.adapter.forward
    monkeypatch.setattr(
        loaded_fp32.adapter,
        "forward",
        lambda ids, *a, **k: packed_rows.append(len(ids)) or forward(ids, *a, **k),
    )
    logits = largest_step(loaded_fp32.adapter, config)()
    assert logits.shape == (7, loaded_fp32.adapter.geometry.vocab_size)  # the most logits a step has
    assert packed_rows[0] >= 300  # every token of the budget in one forward (padded to its row bucket)
    assert torch.isfinite(logits).all()
    one = largest_step(loaded_fp32.adapter, EngineConfig(max_num_batched_tokens=5, max_num_seqs=64))()
    assert one.shape[0] == 5  # no more sequences than tokens


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava", "idefics3"])
def test_every_family_runs_the_largest_step(family_models, family):
    _, loaded = family_models(family)
    logits = largest_step(loaded.adapter, EngineConfig(max_num_batched_tokens=200, max_num_seqs=6))()
    assert logits.shape == (6, loaded.adapter.geometry.vocab_size) and torch.isfinite(logits).all()


def test_the_peak_is_what_the_step_allocates_beyond_what_was_allocated_before(loaded_fp32, monkeypatch):
    """The CUDA allocator's counters, faked: the step must run between the reset and the reading, its
    rows drawn as top-p sampled ones (the sampler's largest buffers)."""
    events = []
    allocated = {"now": 1000, "peak": 1000}
    forward = loaded_fp32.adapter.forward

    def step_forward(*args, **kwargs):
        events.append("forward")
        allocated["peak"] = allocated["now"] + 4321
        return forward(*args, **kwargs)

    def reset(_device):
        events.append("reset")
        allocated["peak"] = allocated["now"]

    def draw(logits, params, generators):
        # the sampler's buffers (a top-p sort of each row) beside the logits: more than the forward's here
        events.append(f"draw {len(params)} rows, top-p {params[0].top_p}")
        allocated["peak"] = max(allocated["peak"], allocated["now"] + 9876)

    monkeypatch.setattr(loaded_fp32.adapter, "forward", step_forward)
    monkeypatch.setattr(activation_peak, "step_picks", draw)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda _device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _device: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda _device: allocated["peak"])
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4)
    assert step_activation_peak(loaded_fp32.adapter, config) == 9876
    assert events == ["reset", "forward", "draw 4 rows, top-p 0.5", "empty_cache"]


def test_the_job_file_takes_auto_or_a_size_and_a_share_up_to_one(tmp_path):
    def engine(**keys) -> EngineConfig:
        data = {"model": {"path": "m"}, "input": {"paths": ["d/*.parquet"]}, "output": {"dir": "o"}}
        return job_config_from_dict({**data, "engine": keys}, tmp_path).engine

    assert engine().kv_cache_mb == "auto" and engine().gpu_memory_utilization == 0.9
    assert engine(kv_cache_mb=2048).kv_cache_mb == 2048.0
    assert engine(kv_cache_mb="auto", gpu_memory_utilization=1).gpu_memory_utilization == 1.0
    with pytest.raises(ConfigError, match="'engine.kv_cache_mb' must be float or auto, got 'lots'"):
        engine(kv_cache_mb="lots")
    with pytest.raises(ConfigError, match="'engine.kv_cache_mb' must be positive"):
        engine(kv_cache_mb=0)
    with pytest.raises(ConfigError, match=r"'engine.gpu_memory_utilization' must be in \(0, 1\]"):
        engine(gpu_memory_utilization=1.5)


def test_a_cache_larger_than_the_machine_is_refused_before_anything_is_made(monkeypatch):
    monkeypatch.setattr(kv_budget.psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * 1024 * MB))
    cpu = torch.device("cpu")
    kv_budget.check_kv_cache_fits(EngineConfig(kv_cache_mb=16 * 1024), cpu)  # the whole memory: allowed
    kv_budget.check_kv_cache_fits(EngineConfig(), cpu)  # auto: sized by the engine
    with pytest.raises(UserError) as info:
        kv_budget.check_kv_cache_fits(EngineConfig(kv_cache_mb=1e12), cpu)
    assert str(info.value) == (
        "engine.kv_cache_mb=1e+12 is more than this machine's memory (16384 MiB); lower it, or set it to auto"
    )


def test_a_cache_without_a_block_names_the_value_the_job_sets_and_the_least_that_runs():
    block = MB // 8  # an eighth of a MiB a block
    kv_budget.check_holds_blocks(EngineConfig(kv_cache_mb=0.25), block, engines=2)  # one block each
    with pytest.raises(UserError) as info:
        kv_budget.check_holds_blocks(EngineConfig(kv_cache_mb=0.1), block, engines=1)
    assert str(info.value) == (
        "engine.kv_cache_mb=0.1 holds no KV block (a block of 16 tokens of this model takes 0.125 MiB); "
        "raise it to at least 0.125"
    )
    with pytest.raises(UserError) as info:  # replicas share the value: the message names the job's
        kv_budget.check_holds_blocks(EngineConfig(kv_cache_mb=0.2), block, engines=2)
    assert "kv_cache_mb=0.2 holds fewer KV blocks than its 2 engine replicas need, one each" in str(
        info.value
    )
    assert str(info.value).endswith("raise it to at least 0.25, or set engine.replicas: 1")


def test_a_run_whose_replicas_share_too_small_a_cache_is_refused_naming_the_jobs_value(loaded_fp32):
    from batchvl.engine.builder import build_engine

    tokenizer, eos = loaded_fp32.processor.tokenizer, loaded_fp32.eos_token_ids()
    config = EngineConfig(kv_cache_mb=0.001, replicas=2)
    with pytest.raises(UserError, match="engine.kv_cache_mb=0.001 holds fewer KV blocks than its 2"):
        build_engine(loaded_fp32.adapter, tokenizer, eos, config)


def test_the_step_size_probe_measures_the_forward_alone(loaded_fp32, monkeypatch):
    """The probe that chooses the step sizes scales its figure with the tokens: the draw's buffers, bounded
    by a piece's size whatever the step, would be scaled with them. The KV budget's probe draws."""
    from batchvl.engine import engine as engine_module

    probes = []
    monkeypatch.setattr(
        engine_module,
        "step_activation_peak",
        lambda adapter, config, draws=True: probes.append(draws) or 1,
    )
    monkeypatch.setattr(
        engine_module,
        "resolved_step_sizes",
        lambda config, device, step_peak, *_: step_peak(config) and config,
    )
    engine_module.step_sizes_for(loaded_fp32.adapter, EngineConfig())
    assert probes == [False]
    drawn = []
    monkeypatch.setattr(
        activation_peak, "step_picks", lambda logits, params, generators: drawn.append(params)
    )
    largest_step(loaded_fp32.adapter, EngineConfig(max_num_batched_tokens=8, max_num_seqs=2), draws=False)()
    assert drawn == []
    largest_step(loaded_fp32.adapter, EngineConfig(max_num_batched_tokens=8, max_num_seqs=2))()
    assert drawn == [[activation_peak.PROBE_SAMPLING] * 2]
