"""Decode steps replayed as graphs (`engine.cuda_graphs`) give the eager path's tokens.

On the CPU the graphs are `FakeGraphCapture`'s: the captured step is called again over the same static
buffers, under a guard that fails on any host synchronisation. With BATCHVL_TEST_DEVICE=cuda they are
real CUDA graphs (the guard cannot run there: the capture itself fails on a synchronisation, and a test
below requires the buckets a job needs twice to have been captured)."""

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import batchvl.engine.model_runner as model_runner
from batchvl.config import EngineConfig
from batchvl.engine.device import decode_graphs
from batchvl.engine.device.decode_graphs import DecodeGraphs
from batchvl.engine.device.graph_capture import graph_capture
from batchvl.engine.engine import Engine
from batchvl.engine.model_runner import ModelRunner
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.layers.attention import KVCache
from batchvl.layers.row_buckets import bucket_rows
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import TEST_DEVICE, random_image
from tests.engine.fake_graphs import FakeGraphCapture, HostSync, NoHostSync

# More running requests than 32 rows, so that steps fall in the buckets of 16, 32 and 48 rows; blocks of 3
# tokens, so that sequences cross block boundaries every few steps
GRAPHED = EngineConfig(
    max_num_seqs=40, max_num_batched_tokens=256, block_size=3, kv_cache_mb=4, cuda_graphs=True
)
NUM_REQUESTS = 48


def workload(loaded) -> list[EngineRequest]:
    """Text prompts of several lengths and budgets, every fourth with an image (M-RoPE positions offset
    from the token count): requests finish at different steps and waiting ones join."""
    renderer = PromptRenderer(loaded.processor)
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    requests = []
    for i in range(NUM_REQUESTS):
        sampling = SamplingParams(max_new_tokens=5 + 6 * (i % 3) + i % 2, ignore_eos=True)
        if i % 4 == 0:
            image = prepare_image(random_image(40 + 8 * (i % 3), 60, seed=i), spec)
            ids = renderer.token_ids(renderer.render(f"Describe picture {i}.", 1), [image])
            requests.append(EngineRequest(ids, [image], sampling, tag=i))
        else:
            requests.append(EngineRequest(list(range(100 + i, 106 + i + i % 11)), [], sampling, tag=i))
    return requests


def run_job(loaded, config: EngineConfig, requests: list[EngineRequest], engine_ready=None) -> dict:
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, config, loaded.eos_token_ids())
    if engine_ready is not None:
        engine_ready(engine)
    for request in requests:
        engine.add_request(request)
    outputs = {}
    while engine.num_unfinished:
        for result in engine.step():
            assert result.error is None
            outputs[result.tag] = result.output_token_ids
        engine.check_integrity()
    return outputs


@pytest.fixture
def capture(monkeypatch):
    """The graphs the engine under test captures: fake ones on the CPU, CUDA's on a GPU."""
    backend = FakeGraphCapture() if TEST_DEVICE == "cpu" else graph_capture(torch.device(TEST_DEVICE))
    monkeypatch.setattr(model_runner, "graph_capture", lambda device: backend)
    return backend


@pytest.fixture(scope="module")
def eager_outputs(loaded_fp32):
    eager = replace(GRAPHED, cuda_graphs=False)
    return run_job(loaded_fp32, eager, workload(loaded_fp32))


def spy_on_steps(monkeypatch) -> list[list]:
    """Each step's [rows, whether a graph ran it, whether it took the previous step's picks on the device],
    appended as the engine runs."""
    steps = []
    execute, run = ModelRunner.execute, DecodeGraphs.run

    def recording_execute(self, chunks, *args, **kwargs):
        steps.append([len(chunks), False, kwargs.get("picks_in_flight") is not None])
        return execute(self, chunks, *args, **kwargs)

    def recording_run(self, chunks, *args):
        logits = run(self, chunks, *args)
        steps[-1][1] = logits is not None
        return logits

    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    monkeypatch.setattr(DecodeGraphs, "run", recording_run)
    return steps


def spy_on_replays(monkeypatch) -> dict[int, list[tuple[int, int]]]:
    """Per bucket of a decode step's rows, for each such step: the rows of the graph it replayed (0: none,
    eager), and the fewest rows of the larger graphs captured when it began (0: none)."""
    replayed: dict[int, list[tuple[int, int]]] = {}
    run, replay = DecodeGraphs.run, DecodeGraphs._replay
    chosen = []

    def recording_replay(self, rows, *key):
        chosen.append(rows)
        return replay(self, rows, *key)

    def recording_run(self, chunks, *args):
        chosen.clear()
        bucket = bucket_rows(len(chunks))
        larger = min((rows for rows, _, _ in self.captured if rows > bucket), default=0)
        logits = run(self, chunks, *args)
        replayed.setdefault(bucket, []).append((chosen[-1] if logits is not None else 0, larger))
        return logits

    monkeypatch.setattr(DecodeGraphs, "_replay", recording_replay)
    monkeypatch.setattr(DecodeGraphs, "run", recording_run)
    return replayed


def graphed_job(loaded, monkeypatch) -> tuple[dict, dict[int, list[int]], DecodeGraphs, list]:
    """The workload with graphs: its outputs, the graphs each bucket's steps replayed, the engine's graphs
    and those captured as it started."""
    replayed = spy_on_replays(monkeypatch)
    graphs, ahead = [], []

    def started(engine):
        graphs.append(engine.runner.decode_graphs)
        ahead.extend(engine.runner.decode_graphs.captured)

    outputs = run_job(loaded, GRAPHED, workload(loaded), started)
    return outputs, replayed, graphs[0], ahead


def test_decode_steps_replayed_as_graphs_give_the_eager_tokens(
    loaded_fp32, eager_outputs, capture, monkeypatch
):
    """The largest bucket's graph is captured as the engine starts; every decode step replays it, those of
    smaller buckets over padding rows, and no other bucket is needed often enough to be captured."""
    steps = spy_on_steps(monkeypatch)
    outputs, replayed, graphs, ahead = graphed_job(loaded_fp32, monkeypatch)
    assert outputs == eager_outputs
    assert [rows for rows, _, _ in ahead] == [48] and graphs.capture_s > 0
    assert graphs.captured == ahead
    assert set(replayed) > {48}
    assert all(graph == 48 for steps in replayed.values() for graph, _ in steps)
    assert {rows for rows, graphed, _ in steps if graphed} - {16, 32, 48}  # rows short of their bucket
    assert sum(graphed for _, graphed, _ in steps) > 15
    assert any(not graphed for _, graphed, _ in steps)  # the prefill steps ran eagerly


def test_a_bucket_that_steps_keep_needing_is_captured_and_replayed_from_then_on(
    loaded_fp32, eager_outputs, capture, monkeypatch
):
    """A bucket needed CAPTURE_OVER_PADDING times gets its own graph, which its steps replay from then on
    instead of the smallest larger one captured (here after 3 needs, which this workload's buckets
    reach)."""
    monkeypatch.setattr(decode_graphs, "CAPTURE_OVER_PADDING", 3)
    outputs, replayed, graphs, ahead = graphed_job(loaded_fp32, monkeypatch)
    assert outputs == eager_outputs
    smaller = {bucket: rows for bucket, rows in replayed.items() if bucket != 48}
    assert smaller and all(len(rows) >= 3 for rows in smaller.values())
    for bucket, steps in smaller.items():
        assert [graph for graph, larger in steps[:2]] == [larger for _, larger in steps[:2]]  # padded
        assert [graph for graph, _ in steps[2:]] == [bucket] * (len(steps) - 2)
    assert sorted(rows for rows, _, _ in graphs.captured) == sorted([48, *smaller])


def test_overlapped_decode_steps_replay_graphs_with_the_picks_swapped_in_on_the_device(
    loaded_fp32, eager_outputs, capture, monkeypatch
):
    """engine.overlap with graphs: a graphed step's placeholders become the previous step's picks in the
    static token buffer before the replay; the tokens are the serial eager engine's."""
    steps = spy_on_steps(monkeypatch)
    outputs = run_job(loaded_fp32, replace(GRAPHED, overlap=True), workload(loaded_fp32))
    assert outputs == eager_outputs
    assert sum(graphed and overlapped for _, graphed, overlapped in steps) > 15


def test_a_graphs_decode_splits_are_the_eager_steps_and_part_of_its_key(
    loaded_fp32, eager_outputs, capture, monkeypatch
):
    """Triton's grouped decode kernel splits long sequences over programs by the step's mean keys; the graph's
    pages buffer has room for the longest sequences, so the graph takes the step's own pages (each row's sums
    then run in the eager step's order), and a bucket is captured once per split count. (The CPU's kernels
    have no splits: here the graph is told they matter, and its kernels drop them.)"""
    graphs, ahead = [], []

    def splits_matter(engine):  # from the first step on: the graphs captured ahead have no splits
        engine.runner.decode_graphs.splits_matter = True
        graphs.append(engine.runner.decode_graphs)
        ahead.extend(engine.runner.decode_graphs.captured)

    outputs = run_job(loaded_fp32, GRAPHED, workload(loaded_fp32), splits_matter)
    assert outputs == eager_outputs
    # short sequences, one program each: captured as steps needed them here (ahead, where the kernels'
    # splits matter from the start: on CUDA)
    assert {splits for _, _, splits in graphs[0].captured} - {None} == {1}
    assert all(splits == 1 for _, _, splits in graphs[0].captured[len(ahead) :])
    # 8 sequences of 1,500 keys: 4 splits of 375 keys (8 of 187 would be under 256 keys each)
    assert graphs[0]._splits(np.full(8, 1500)) == 4
    assert graphs[0]._splits(np.full(8, 100)) == 1
    graphs[0].splits_matter = False
    assert graphs[0]._splits(np.full(8, 1500)) is None


# (the pages are the runner's block table, which eager steps read too: every parity test needs it synced)
STATIC_INPUTS = ["token_ids", "positions", "slots", "starts", "lengths"]


class LeaveStale(TorchFunctionMode):
    """Drops every copy into one static buffer: the replays then read what the captures left there, as
    when steps forget to fill it. (Safe to replay: whatever a buffer holds, a row's pages lie inside the
    block table.)"""

    def __init__(self, buffer: torch.Tensor):
        super().__init__()
        self.storage = buffer.untyped_storage().data_ptr()
        self.dropped = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and args[0].untyped_storage().data_ptr() == self.storage:
            self.dropped += 1
            return args[0]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", STATIC_INPUTS)
def test_a_static_input_left_stale_changes_the_tokens(loaded_fp32, eager_outputs, capture, name):
    """A step that does not copy one of its inputs into its buffer gives other tokens: the test above
    would catch it."""
    modes = []

    def leave_stale(engine):  # from the first step on (the captures ahead fill the buffers)
        modes.append(LeaveStale(engine.runner.decode_graphs.buffers[name]))
        modes[0].__enter__()

    try:
        outputs = run_job(loaded_fp32, GRAPHED, workload(loaded_fp32), leave_stale)
    finally:
        modes[0].__exit__(None, None, None)
    assert modes[0].dropped > 5
    assert outputs != eager_outputs


@pytest.mark.parametrize("inference", [True, False], ids=["inference-mode", "grad-mode"])
def test_the_guard_fails_on_every_kind_of_host_synchronisation(inference):
    with torch.inference_mode(inference):
        guard_catches_host_synchronisation()


def guard_catches_host_synchronisation():
    values = torch.arange(6)
    syncs = [
        lambda: values[2].item(),
        lambda: bool(values[1]),
        lambda: values.tolist(),
        lambda: values.cpu(),
        lambda: values[values > 2],
        lambda: values.nonzero(),
        lambda: torch.unique(values),
        lambda: torch.equal(values, values),
    ]
    for sync in syncs:
        with pytest.raises(HostSync), NoHostSync():
            sync()
    with NoHostSync():  # what a captured step does: work on the device, shapes known to the host
        (values * 2).index_select(0, values[:3]).sum()


def test_padding_rows_write_only_a_scratch_slot_beyond_the_block_managers(loaded_fp32, monkeypatch):
    monkeypatch.setattr(model_runner, "graph_capture", lambda device: FakeGraphCapture())
    written = []
    write = KVCache.write

    def recording_write(self, layer, slots, key, value):
        if layer == 0:
            written.append(slots.clone())
        return write(self, layer, slots, key, value)

    engines, ahead = [], []

    def started(engine):  # the capture as the engine started: padding rows only
        engines.append(engine)
        ahead.extend(slots.tolist() for slots in written)
        written.clear()

    # fixed sizes: with `auto` on a GPU, the steps measured to choose them write slots too
    sizes = {"kv_cache_mb": 64, "max_num_batched_tokens": 2048, "max_patches_per_encode": 4096}
    config = EngineConfig(max_num_seqs=8, block_size=4, cuda_graphs=True, **sizes)
    sampling = SamplingParams(max_new_tokens=3, ignore_eos=True)
    requests = [EngineRequest(list(range(100, 105 + i)), [], sampling, tag=i) for i in range(3)]
    monkeypatch.setattr(KVCache, "write", recording_write)
    run_job(loaded_fp32, config, requests, started)
    engine = engines[0]
    scratch = engine.block_manager.capacity_tokens  # the first slot of the one block no request is given
    assert engine.runner.kv_cache.layers[0].shape[2] == scratch + config.block_size
    assert ahead == [[scratch] * 16]
    graphed = [slots.tolist() for slots in written if len(slots) == 16]  # the decode steps' (bucket 16)
    assert len(graphed) >= 2
    for slots in graphed:
        real = [slot for slot in slots if slot != scratch]
        assert slots == real + [scratch] * (16 - len(real)) and 0 < len(real) <= 3 and max(real) < scratch
    assert torch.isfinite(engine.runner.kv_cache.layers[0][:, :, scratch]).all()


def run_classifying_steps(loaded, monkeypatch, config, requests, graph_rows):
    """The job with graphs of at most `graph_rows` rows, against the eager job: the tokens are the same,
    and a step replays a graph exactly where it is decodes only and no more rows than that. Returns each
    step's (rows, decodes only)."""
    config = replace(config, cuda_graphs=False, overlap=False)  # `auto` turns both on on a GPU
    eager = run_job(loaded, config, requests)
    monkeypatch.setattr(model_runner, "graph_capture", lambda device: FakeGraphCapture())
    steps = spy_on_steps(monkeypatch)
    kinds = []
    execute = ModelRunner.execute

    def classifying_execute(self, chunks, *args):
        decodes_only = all(
            chunk.num_tokens == 1
            and chunk.start >= chunk.request.num_prompt_tokens
            and chunk.request.score_from is None
            for chunk in chunks
        )
        kinds.append((len(chunks), decodes_only))
        return execute(self, chunks, *args)

    monkeypatch.setattr(ModelRunner, "execute", classifying_execute)

    def with_fewer_graph_rows(engine):
        engine.runner = ModelRunner(engine.adapter, engine.block_manager, decode_graph_rows=graph_rows)

    assert run_job(loaded, config, requests, with_fewer_graph_rows) == eager
    expected = [decodes_only and rows <= graph_rows for rows, decodes_only in kinds]
    assert [graphed for _, graphed, _ in steps] == expected
    assert any(expected) and not all(expected)
    return kinds


def test_steps_with_prompts_scores_or_more_rows_than_the_graphs_run_eagerly(loaded_fp32, monkeypatch):
    """Prefill chunks (with or without media), scoring requests' chunks and decode steps of more rows than
    the largest bucket go the eager way; every other step replays a graph, and the tokens are the same."""
    requests = workload(loaded_fp32)[:24]
    requests.append(
        EngineRequest(list(range(50, 60)), [], SamplingParams(4), "scored", scored_choices=("a", "b"))
    )
    config = EngineConfig(max_num_seqs=40, max_num_batched_tokens=96, block_size=3, kv_cache_mb=4)
    kinds = run_classifying_steps(loaded_fp32, monkeypatch, config, requests, graph_rows=16)
    assert any(decodes_only and rows > 16 for rows, decodes_only in kinds)  # too many rows: eager


def test_a_prompts_last_token_alone_among_decodes_runs_eagerly(loaded_fp32, monkeypatch):
    """With a budget of one token more than the decodes, a waiting prompt is fed a token a step: its last
    chunk is one token that samples, like a decode, but it is the prompt's (a graph would feed an output
    token that does not exist yet)."""
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    requests = [EngineRequest(list(range(100 + i, 104 + 2 * i)), [], sampling, tag=i) for i in range(4)]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=4, block_size=3, kv_cache_mb=1)
    kinds = run_classifying_steps(loaded_fp32, monkeypatch, config, requests, graph_rows=4)
    assert any(rows == 4 and not decodes_only for rows, decodes_only in kinds)  # a prompt token, 3 decodes


class FailingCapture:
    def capture(self, forward):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_step_that_cannot_be_captured_runs_eagerly_from_then_on(
    loaded_fp32, eager_outputs, monkeypatch, caplog
):
    monkeypatch.setattr(model_runner, "graph_capture", lambda device: FailingCapture())
    steps = spy_on_steps(monkeypatch)
    with caplog.at_level(logging.WARNING):
        outputs = run_job(loaded_fp32, GRAPHED, workload(loaded_fp32))
    assert outputs == eager_outputs
    assert not any(graphed for _, graphed, _ in steps)
    assert [record.message for record in caplog.records if "eagerly" in record.message] == [
        "decode steps run eagerly: capturing one as a graph failed "
        "(operation not permitted when stream is capturing)"
    ]


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a CPU's engine")
def test_the_option_is_ignored_off_cuda(loaded_fp32):
    engine = Engine(
        loaded_fp32.adapter,
        loaded_fp32.processor.tokenizer,
        EngineConfig(block_size=4, kv_cache_mb=1, cuda_graphs=True),
        loaded_fp32.eos_token_ids(),
    )
    assert engine.runner.decode_graphs is None
    slots = engine.runner.kv_cache.layers[0].shape[2]
    assert slots == engine.block_manager.capacity_tokens  # no scratch block either


def text_requests(count: int) -> list[EngineRequest]:
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    return [EngineRequest(list(range(40 + i, 47 + 3 * i)), [], sampling, tag=i) for i in range(count)]


def graphed_against_eager(loaded, monkeypatch) -> tuple[dict, dict, FakeGraphCapture]:
    config = EngineConfig(max_num_seqs=8, block_size=4, kv_cache_mb=1, cuda_graphs=False, overlap=False)
    eager = run_job(loaded, config, text_requests(5))
    fake = FakeGraphCapture()
    monkeypatch.setattr(model_runner, "graph_capture", lambda device: fake)
    return run_job(loaded, replace(config, cuda_graphs=True), text_requests(5)), eager, fake


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's swapped modules, turned off")
def test_the_decoders_own_modules_synchronise_nothing_either(tiny_model_dir, monkeypatch):
    """On CUDA the CPU's module swaps (packed linears, native RMSNorm, fused activations) do not apply: the
    decoder's own transformers modules run, and they too are captured without a host synchronisation."""
    import batchvl.layers.fused_activation as fused_activation
    import batchvl.layers.packed_linear as packed_linear
    import batchvl.layers.rms_norm as rms_norm
    from batchvl.models.loader import load_model

    with monkeypatch.context() as unswapped:
        unswapped.setattr(fused_activation, "fuse_mlp_activations", lambda model: 0)
        unswapped.setattr(rms_norm, "use_native_rms_norms", lambda model: 0)
        unswapped.setattr(packed_linear, "pack_linear_weights", lambda model: 0)
        loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    swapped = {module.__name__ for module in (fused_activation, packed_linear, rms_norm)}
    assert not any(type(module).__module__ in swapped for module in loaded.adapter.model.modules())
    graphed, eager, fake = graphed_against_eager(loaded, monkeypatch)
    assert graphed == eager and fake.replays >= 4


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava", "idefics3"])
def test_every_family_replays_decode_steps_as_graphs(family_models, family, monkeypatch):
    _, loaded = family_models(family)
    graphed, eager, fake = graphed_against_eager(loaded, monkeypatch)
    if TEST_DEVICE == "cpu":
        assert fake.replays >= 4
    assert graphed == eager
