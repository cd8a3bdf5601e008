"""Qwen2-VL's vision calls replayed as graphs (`engine.vision_graphs`) give what the call gives eagerly.

On the CPU the graphs are `FakeGraphCapture`'s (the captured call is run again over the same static
buffers, under a guard that fails on any host synchronisation), and the tower's varlen attention kernel, a
GPU's, is stood in for by `reference_varlen`: torch's attention over the packed rows, each row attending
within its sequence found from the boundaries on the device, so that it reads nothing back either. With
BATCHVL_TEST_DEVICE=cuda the model is in bf16 on the GPU, the kernel is the real one and the graphs CUDA's.
"""

import logging

import pytest
import torch
import torch.nn.functional as F

import batchvl.engine.model_runner as model_runner
from batchvl.config import EngineConfig
from batchvl.engine.device.graph_capture import graph_capture
from batchvl.engine.engine import Engine
from batchvl.engine.model_runner import encode_images
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.layers import vision_attention
from batchvl.models import qwen_vision_graphs
from batchvl.models.qwen_vision_graphs import ROWS_STEP, CallShape, Cut
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import TEST_DEVICE, random_image
from tests.engine.fake_graphs import FakeGraphCapture
from tests.engine.test_decode_graphs import run_job

ON_CPU = TEST_DEVICE == "cpu"
MAX_PATCHES = 2 * ROWS_STEP


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None):
    """The varlen kernel's maths on (T, H, D) rows cut into sequences at `cu_q`: each row attends to the
    rows of its own sequence. Sequences of no rows (repeated boundaries) hold no row. `max_q` is recorded
    (the kernel's bound, which must cover every sequence)."""
    bounds_seen.append(max_q)
    rows = torch.arange(q.shape[0], device=q.device)
    sequence = torch.bucketize(rows, cu_q[1:].long(), right=True)
    same = sequence[:, None] == sequence[None, :]
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), same, scale=softmax_scale)
    return out.transpose(0, 1)


bounds_seen: list[int] = []


DTYPE = "float32" if ON_CPU else "bfloat16"  # (the varlen kernel takes no fp32)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """The tiny Qwen2-VL of its own (its adapter's graphs are this module's): fp32 on the CPU, bf16 on a
    GPU."""
    from batchvl.models.loader import load_model

    return load_model(str(tiny_model_dir), dtype=DTYPE, device=TEST_DEVICE)


@pytest.fixture(scope="module")
def other_family(family_models):
    """family -> the tiny model of that family, as `loaded` (the shared fp32 one on the CPU)."""
    from batchvl.models.loader import load_model

    loaded_in = {}

    def get(family: str):
        if family not in loaded_in:
            path, fp32 = family_models(family)
            loaded_in[family] = fp32 if ON_CPU else load_model(str(path), dtype=DTYPE, device=TEST_DEVICE)
        return loaded_in[family]

    return get


@pytest.fixture
def varlen_kernel(monkeypatch):
    """On the CPU, `reference_varlen` as the varlen kernel the tower's attention calls."""
    bounds_seen.clear()
    if ON_CPU:
        monkeypatch.setattr(vision_attention, "flash_varlen_runs", lambda dtype, device: True)
        monkeypatch.setattr(vision_attention, "_varlen_kernel", lambda: ("reference", reference_varlen))


@pytest.fixture
def capture(loaded, varlen_kernel):
    """The adapter's vision calls of up to MAX_PATCHES patches replayed as graphs: fake ones on the CPU,
    CUDA's on a GPU; eager again after the test."""
    backend = FakeGraphCapture() if ON_CPU else graph_capture(torch.device(TEST_DEVICE))
    assert loaded.adapter.use_vision_graphs(backend, MAX_PATCHES)
    yield backend
    loaded.adapter.use_vision_graphs(None, 0)


def images(loaded, sides: list[tuple[int, int]], seed: int) -> list:
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    return [prepare_image(random_image(w, h, seed=seed + i), spec) for i, (w, h) in enumerate(sides)]


def embeddings(loaded, media: list, max_patches: int = MAX_PATCHES) -> list[torch.Tensor]:
    return [row.float().cpu() for row in encode_images(loaded.adapter, media, max_patches)]


# Two calls of one shape whose images differ in number, grids and pixels (the tiny model's images have at
# most 256 patches): 256 + 128 and 128 + 64 + 96 patches, each call padded to 1,024 rows by one blank image
# (640 and 736 rows), so 3 and 4 sequences (8 in the shape) and the longest bound 1,024. A replay over
# buffers that one of its copies missed would give the other call's values.
TWO_IMAGES = [(224, 224), (112, 224)]
THREE_IMAGES = [(224, 112), (112, 112), (168, 112)]
CALL_SHAPE = CallShape(
    rows=ROWS_STEP,
    cuts=(Cut("cu_seqlens", sequences=8, longest=1024),),
    others=(("position_ids", (ROWS_STEP, 2), "torch.int64"),),
)


def test_a_replay_gives_the_call_run_eagerly_at_its_shape_bit_for_bit(loaded, capture):
    first, second = images(loaded, TWO_IMAGES, seed=0), images(loaded, THREE_IMAGES, seed=10)
    assert [m.num_patches for m in first + second] == [256, 128, 128, 64, 96]

    eager_first = embeddings(loaded, first)  # the shape's first call: eager, at the shape
    # captured now, and replayed; kept as the call returned them, while the next call replays the graph
    # again (on a GPU a replay's outputs are in the graphs' pool, which the next one writes over)
    replayed_first = encode_images(loaded.adapter, first, MAX_PATCHES)
    replayed_second = embeddings(loaded, second)
    replayed_first = [row.float().cpu() for row in replayed_first]
    graphs = loaded.adapter.vision_graphs
    assert graphs.captured == [CALL_SHAPE]
    assert (graphs.replays, graphs.eager_calls) == (2, 1)
    for eager, replayed in zip(eager_first, replayed_first, strict=True):
        assert torch.equal(eager, replayed)

    # the second images' first call, eager at the same shape, in graphs of their own
    loaded.adapter.use_vision_graphs(
        FakeGraphCapture() if ON_CPU else graph_capture(graphs.device), MAX_PATCHES
    )
    for eager, replayed in zip(embeddings(loaded, second), replayed_second, strict=True):
        assert torch.equal(eager, replayed)
    assert loaded.adapter.vision_graphs.replays == 0


def test_graphed_calls_give_the_towers_own_embeddings(loaded, capture):
    """Against the call made as without graphs (the tower's own attention on the CPU): the padding rows,
    the sequences of no rows and the bound change no image's embedding."""
    media = images(loaded, THREE_IMAGES, seed=20)
    graphed = [embeddings(loaded, media) for _ in range(3)]  # eager at the shape, then two replays
    loaded.adapter.use_vision_graphs(None, 0)
    if ON_CPU:  # the tower's own attention, not the stand-in
        capture_off = pytest.MonkeyPatch()
        capture_off.setattr(vision_attention, "flash_varlen_runs", lambda dtype, device: False)
    try:
        plain = embeddings(loaded, media)
    finally:
        if ON_CPU:
            capture_off.undo()
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if ON_CPU else {"atol": 0.05, "rtol": 0.05}
    for run in graphed:
        for got, want in zip(run, plain, strict=True):
            torch.testing.assert_close(got, want, **tolerance)


def test_the_kernel_gets_the_shapes_bound_and_nothing_is_read_back(loaded, capture):
    if not ON_CPU:
        pytest.skip("the bound is recorded by the CPU's stand-in kernel")
    media = images(loaded, [(224, 224)], seed=30)  # 256 patches, with 768 blank rows: the bound 1,024
    for _ in range(3):
        embeddings(loaded, media)
    assert capture.captures == 1 and capture.warmups == [0]
    assert set(bounds_seen) == {1024}  # eager at the shape, the recording and the replay alike
    assert not loaded.adapter.vision_graphs._failed  # the guard raised on no host read


def test_a_call_larger_than_the_largest_shape_runs_eagerly_unpadded(loaded, capture):
    if not ON_CPU:
        pytest.skip("the rows a CPU call is padded to are the CPU's")
    media = images(loaded, [(224, 224)] * 9, seed=40)  # 2,304 patches in one call
    rows = sum(m.num_patches for m in media)
    assert rows > MAX_PATCHES
    assert loaded.adapter.vision_call_rows(rows) != qwen_vision_graphs.padded_rows(rows)
    for _ in range(3):
        embeddings(loaded, media, max_patches=4 * ROWS_STEP)
    assert capture.captures == 0 and loaded.adapter.vision_graphs._needs == {}


def test_a_failed_capture_leaves_every_later_call_eager(loaded, capture, caplog):
    if not ON_CPU:
        pytest.skip("the failure is the fake's")

    def failing(forward, warmups=2):
        raise RuntimeError("operation not permitted when stream is capturing")

    capture.capture = failing
    media = images(loaded, TWO_IMAGES, seed=50)
    with caplog.at_level(logging.WARNING):
        results = [embeddings(loaded, media) for _ in range(3)]
    assert "vision calls run eagerly" in caplog.text
    assert not loaded.adapter.vision_graphs.takes(ROWS_STEP)
    assert loaded.adapter.vision_graphs.eager_calls == 2  # the shape's first call, and the failed capture's
    for run in results[1:]:
        for got, want in zip(run, results[0], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def requests(loaded) -> list[EngineRequest]:
    renderer = PromptRenderer(loaded.processor)
    out = []
    for i, sides in enumerate([TWO_IMAGES[:1], THREE_IMAGES[:1], TWO_IMAGES[1:], [(224, 224)]] * 3):
        media = images(loaded, sides, seed=100 + i)
        ids = renderer.token_ids(renderer.render(f"Describe picture {i}.", len(media)), media)
        out.append(EngineRequest(ids, media, SamplingParams(max_new_tokens=6, ignore_eos=True), tag=i))
    return out


def job_tokens(loaded, vision_graphs: bool) -> tuple[dict, object]:
    """The job's tokens by request, and the adapter's vision graphs after it."""
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=512, kv_cache_mb=8, max_patches_per_encode=MAX_PATCHES,
        vision_graphs=vision_graphs, prefix_caching=False,
    )  # fmt: skip
    return run_job(loaded, config, requests(loaded)), loaded.adapter.vision_graphs


def test_a_job_with_vision_graphs_gives_the_tokens_of_one_without(loaded, varlen_kernel, monkeypatch):
    if not ON_CPU:
        pytest.skip("bf16 graphs run at other shapes than the eager calls: tokens may part")
    backend = FakeGraphCapture()
    monkeypatch.setattr(model_runner, "graph_capture", lambda device: backend)
    try:
        with_graphs, graphs = job_tokens(loaded, vision_graphs=True)
        assert graphs is not None and graphs.replays > 0
        without, graphs = job_tokens(loaded, vision_graphs=False)
        assert graphs is None
    finally:
        loaded.adapter.use_vision_graphs(None, 0)
    assert with_graphs == without


def test_on_the_cpu_the_engine_captures_no_vision_graph(loaded):
    if not ON_CPU:
        pytest.skip("the CPU's engine")
    config = EngineConfig(kv_cache_mb=8, vision_graphs=True)
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, config, loaded.eos_token_ids())
    assert engine.config.vision_graphs is True and engine.runner.vision_graphs_on is False
    assert loaded.adapter.vision_graphs is None


def test_auto_is_off_until_measured(loaded):
    from batchvl.engine.fast_paths import fast_paths_resolved

    cuda = torch.device("cuda", 0)
    assert fast_paths_resolved(EngineConfig(), cuda).vision_graphs is False
    assert fast_paths_resolved(EngineConfig(vision_graphs=True), cuda).vision_graphs is True


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_other_qwen_towers_replay_their_eager_calls(family, other_family, varlen_kernel):
    """Qwen2.5-VL's windows (a second cut, its own bound) and Qwen3-VL's interpolated position embeddings
    and deepstack features (more outputs, each copied out): a replay gives the call run eagerly at its
    shape, over images of the same sizes and other pixels too, and the tower's own embeddings."""
    other = other_family(family)
    adapter = other.adapter

    def fresh_graphs():
        backend = FakeGraphCapture() if ON_CPU else graph_capture(torch.device(TEST_DEVICE))
        assert adapter.use_vision_graphs(backend, MAX_PATCHES)

    first, second = images(other, TWO_IMAGES, seed=60), images(other, TWO_IMAGES, seed=70)
    try:
        fresh_graphs()
        eager_first = embeddings(other, first)
        replayed = [embeddings(other, first), embeddings(other, second)]
        graphs = adapter.vision_graphs
        assert graphs.replays == 2 and len(graphs.captured) == 1
        names = [cut.name for cut in graphs.captured[0].cuts]
        assert names == (["cu_seqlens", "cu_window_seqlens"] if family == "qwen2_5_vl" else ["cu_seqlens"])
        fresh_graphs()
        eager_second = embeddings(other, second)
        adapter.use_vision_graphs(None, 0)
        plain = [embeddings(other, first), embeddings(other, second)]
    finally:
        adapter.use_vision_graphs(None, 0)
    for eager, got in zip(eager_first + eager_second, replayed[0] + replayed[1], strict=True):
        assert torch.equal(eager, got)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if ON_CPU else {"atol": 0.05, "rtol": 0.05}
    for want, got in zip(plain[0] + plain[1], replayed[0] + replayed[1], strict=True):
        torch.testing.assert_close(got, want, **tolerance)


def test_towers_without_the_varlen_attention_take_no_graphs(loaded, family_models, varlen_kernel):
    """LLaVA's tower; and Qwen2-VL's attending by SDPA (`engine.vision_attention: sdpa`)."""
    _, llava = family_models("llava")
    assert llava.adapter.use_vision_graphs(FakeGraphCapture(), MAX_PATCHES) is False
    attentions = [m for m in loaded.adapter.model.modules() if hasattr(m, vision_attention.VARLEN_ATTRIBUTE)]
    assert attentions
    try:
        setattr(attentions[0], vision_attention.VARLEN_ATTRIBUTE, False)
        assert loaded.adapter.use_vision_graphs(FakeGraphCapture(), MAX_PATCHES) is False
        assert loaded.adapter.vision_graphs is None
    finally:
        setattr(attentions[0], vision_attention.VARLEN_ATTRIBUTE, True)
    assert loaded.adapter.use_vision_graphs(FakeGraphCapture(), MAX_PATCHES) is True  # and with it
    loaded.adapter.use_vision_graphs(None, 0)


def test_a_shape_is_its_rows_its_cuts_and_the_other_inputs_layout():
    """Calls whose inputs differ in values alone share a shape; an input of another shape, dtype or value
    that is not a bound makes another one (a graph records them as they were)."""
    boundaries = torch.tensor([0, 256, 384, 1024], dtype=torch.int32)
    call = {
        "cu_seqlens": boundaries,
        "max_seqlen": 640,
        "position_ids": torch.zeros(1024, 2, dtype=torch.long),
    }
    shape = CallShape.of(1024, call)
    assert shape.cuts == (Cut("cu_seqlens", sequences=8, longest=1024),)
    other_values = {**call, "cu_seqlens": torch.tensor([0, 128, 384, 1024], dtype=torch.int32)}
    other_values["position_ids"] = torch.ones(1024, 2, dtype=torch.long)
    assert CallShape.of(1024, other_values) == shape
    for changed in (
        {"position_ids": torch.zeros(1024, 3, dtype=torch.long)},
        {"position_ids": torch.zeros(1024, 2, dtype=torch.int32)},
        {"extra": 3},
    ):
        assert CallShape.of(1024, {**call, **changed}) != shape
    shaped = shape.inputs(call)
    assert shaped["max_seqlen"] == 1024
    assert shaped["cu_seqlens"].tolist() == [0, 256, 384, 1024, 1024, 1024, 1024, 1024, 1024]
