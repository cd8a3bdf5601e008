"""Engine replicas on the CPU (`engine.replicas`): engines over one loaded model stepping side by side in
threads of their own write what one engine writes, which is what `generate` writes; a request goes to the
replica that holds its image; each replica's thread runs with its share of torch's threads, and the
threads of replicas waiting for requests go to those with work; and a replica's exception reaches the job
instead of hanging it."""

import math
import os
import threading
import time

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.parallel.replicas import (
    MOST_WEIGHT_BYTES_FOR_REPLICAS,
    EngineReplicas,
    replica_config,
    replica_count,
)
from batchvl.engine.request import EngineRequest, EngineResult
from batchvl.engine.sampling.params import SamplingParams
from batchvl.errors import UserError
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenVisionSpec, prepare_image
from tests.conftest import random_image, reference_processor
from tests.engine.reference import make_case

MAX_NEW_TOKENS = 8
IMAGE_SIZES = [(100, 150), (60, 60), (200, 90), (28, 300), (90, 90), (140, 56)]
PROMPT = "Describe this image."


def run_to_the_end(engine, requests: list[EngineRequest], timeout_s: float = 120) -> dict:
    """tag -> result, each request answered once."""
    for request in requests:
        engine.add_request(request)
    results: dict = {}
    deadline = time.monotonic() + timeout_s
    while engine.num_unfinished:
        assert time.monotonic() < deadline, "the replicas stopped answering"
        for result in engine.step():
            assert result.tag not in results, f"{result.tag} answered twice"
            results[result.tag] = result
    return results


@pytest.fixture(scope="module")
def cases(tiny_model_dir, loaded_fp32):
    """A case per image (images 0 and 2 appear twice), with generate's tokens."""
    reference = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    images = [random_image(h, w, seed) for seed, (h, w) in enumerate(IMAGE_SIZES)]
    images += [images[0], images[2]]
    processor = reference_processor(tiny_model_dir)
    renderer = PromptRenderer(loaded_fp32.processor)
    spec = QwenVisionSpec.from_image_processor(loaded_fp32.processor.image_processor)
    rendered = renderer.render(PROMPT, 1)
    out = []
    for i, image in enumerate(images):
        prepared = prepare_image(image, spec)
        ids = renderer.token_ids(rendered, [prepared])
        inputs = processor(text=[rendered], images=[image], return_tensors="pt")
        out.append(make_case(reference, i, ids, [prepared], inputs, MAX_NEW_TOKENS))
    return out


def test_two_replicas_write_what_generate_writes(loaded_fp32, cases):
    config = EngineConfig(max_num_batched_tokens=48, block_size=4, max_num_seqs=3)

    def make_engine():
        return Engine(
            loaded_fp32.adapter, loaded_fp32.processor.tokenizer, config, loaded_fp32.eos_token_ids()
        )

    replicas = EngineReplicas(make_engine, count=2, threads_each=1)
    try:
        requests = [
            EngineRequest(case.ids, case.media, SamplingParams(MAX_NEW_TOKENS), case.tag) for case in cases
        ]
        results = run_to_the_end(replicas, requests)
    finally:
        replicas.close()
    for case in cases:
        result = results[case.tag]
        assert result.error is None, (case.tag, result.error)
        assert result.output_token_ids == case.expected.tokens, case.tag
    per_replica = [replica.engine.stats for replica in replicas._replicas]
    assert all(stats.output_tokens for stats in per_replica), "one replica did all the work"
    # The repeated images went where their embeddings were: each distinct image encoded once in all.
    assert sum(stats.images_encoded for stats in per_replica) == len(IMAGE_SIZES)
    assert replicas.stats.output_tokens == MAX_NEW_TOKENS * len(cases)


class FakeEngine:
    """An engine whose step answers one request at a time, recording the thread's torch thread count."""

    config = EngineConfig(lookahead=4)

    def __init__(self, fail_on: str | None = None):
        self.waiting: list[EngineRequest] = []
        self.answered: list[str] = []
        self.thread_counts: set[int] = set()
        self.fail_on = fail_on

    @property
    def stats(self):
        from batchvl.engine.stats import EngineStats

        return EngineStats(output_tokens=len(self.answered))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add_request(self, item: EngineRequest) -> None:
        self.waiting.append(item)

    def step(self) -> list[EngineResult]:
        self.thread_counts.add(torch.get_num_threads())
        time.sleep(0.002)
        item = self.waiting.pop(0)
        if item.tag == self.fail_on:
            raise RuntimeError(f"a bug while stepping {item.tag}")
        self.answered.append(item.tag)
        return [EngineResult(item.tag, output_token_ids=[1])]


class FakeImage:
    def __init__(self, content_hash: str):
        self.content_hash = content_hash


def request(tag: str, image: str | None = None) -> EngineRequest:
    return EngineRequest([1, 2], [FakeImage(image)] if image else [], SamplingParams(1), tag)


def test_each_replica_thread_runs_with_its_share_of_threads_and_the_main_thread_keeps_its_own():
    engines = [FakeEngine(), FakeEngine()]
    before = torch.get_num_threads()
    replicas = EngineReplicas(iter(engines).__next__, count=2, threads_each=1)
    try:
        run_to_the_end(replicas, [request(f"r{i}") for i in range(12)])
    finally:
        replicas.close()
    # its own thread, and the other's while that one waits for requests (at the job's end)
    assert all(engine.thread_counts <= {1, 2} for engine in engines)
    assert all(engine.answered for engine in engines)
    assert torch.get_num_threads() == before


def test_a_replica_with_work_runs_on_the_threads_of_those_waiting_for_requests():
    engines = [FakeEngine(), FakeEngine(), FakeEngine()]
    replicas = EngineReplicas(iter(engines).__next__, count=3, threads_each=2)
    try:
        # one image's requests, no more than a window: all go to the replica that holds it
        run_to_the_end(replicas, [request(f"a{i}", "a") for i in range(FakeEngine.config.lookahead + 1)])
    finally:
        replicas.close()
    assert [bool(engine.answered) for engine in engines] == [True, False, False]
    assert engines[0].thread_counts == {6}


class LockstepEngine(FakeEngine):
    """A fake engine whose first two steps wait for the other replica's at a barrier and answer nothing, so
    that both replicas have work as their second steps start; later steps answer all it holds once it
    holds `requests`. It records each step's thread count."""

    def __init__(self, barrier: threading.Barrier, requests: int):
        super().__init__()
        self.barrier = barrier
        self.requests = requests
        self.step_threads: list[int] = []

    def step(self) -> list[EngineResult]:
        self.step_threads.append(torch.get_num_threads())
        if len(self.step_threads) <= 2:
            self.barrier.wait(timeout=10)
            return []
        if len(self.waiting) < self.requests:
            time.sleep(0.002)
            return []
        answered, self.waiting = self.waiting, []
        return [EngineResult(item.tag, output_token_ids=[1]) for item in answered]


def test_a_replica_gives_the_threads_back_once_the_others_have_work():
    barrier = threading.Barrier(2)
    engines = [LockstepEngine(barrier, 3), LockstepEngine(barrier, 3)]
    replicas = EngineReplicas(iter(engines).__next__, count=2, threads_each=1)
    try:
        # an image a replica, three requests each
        run_to_the_end(replicas, [request(f"{image}{i}", image) for i in range(3) for image in "ab"])
    finally:
        replicas.close()
    # (the first step may start before the other replica has taken its first request, so it may run on
    # both threads; the second starts once both have work)
    assert [engine.step_threads[1] for engine in engines] == [1, 1]


class TailEngine(FakeEngine):
    """A fake engine that answers nothing until `until()` holds, then once more, then all it holds; it
    records each step's thread count."""

    def __init__(self):
        super().__init__()
        self.until = lambda: False
        self.step_threads: list[int] = []
        self.seen = False

    def step(self) -> list[EngineResult]:
        self.step_threads.append(torch.get_num_threads())
        if not self.seen:
            self.seen = self.until()
            time.sleep(0.002)
            return []
        answered, self.waiting = self.waiting, []
        return [EngineResult(item.tag, output_token_ids=[1]) for item in answered]


def test_a_replica_whose_work_ran_out_lends_its_threads_to_the_one_still_working():
    tail, short = TailEngine(), FakeEngine()
    replicas = EngineReplicas(iter([tail, short]).__next__, count=2, threads_each=1)
    # the tail's replica steps on until the other has answered its request and waits for another
    tail.until = lambda: bool(short.answered) and replicas._replicas[1].idle
    try:
        run_to_the_end(replicas, [request("a0", "a"), request("b0", "b"), request("a1", "a")], timeout_s=10)
    finally:
        replicas.close()
    assert short.answered == ["b0"]
    assert tail.step_threads[-1] == 2  # the step after the other's work ran out


def test_the_threads_of_idle_replicas_are_shared_evenly_among_those_with_work():
    replicas = EngineReplicas(FakeEngine, count=4, threads_each=2)
    replicas.close()  # the shares alone, with no thread setting the flags

    def working_shares(*idle: bool) -> list[int]:
        """The threads each replica with work takes, given which replicas wait for requests."""
        for replica, is_idle in zip(replicas._replicas, idle, strict=True):
            replica.idle = is_idle
        return [replicas._threads_for(index) for index, is_idle in enumerate(idle) if not is_idle]

    assert working_shares(False, False, False, False) == [2, 2, 2, 2]
    assert working_shares(False, False, False, True) == [3, 3, 2]  # 2 lent: the first replicas' each
    assert working_shares(True, False, True, False) == [4, 4]
    assert working_shares(True, True, False, True) == [8]
    # a replica about to step has work, whatever its flag still says: it lends nothing to itself
    replicas._replicas[2].idle = True
    assert replicas._threads_for(2) == 8


def test_a_request_goes_to_the_replica_that_holds_its_image():
    engines = [FakeEngine(), FakeEngine()]
    replicas = EngineReplicas(iter(engines).__next__, count=2, threads_each=1)
    try:
        # in image order: sent by load alone, consecutive requests would alternate between the replicas
        requests = [request(f"{image}{i}", image) for image in "abcd" for i in range(3)]
        results = run_to_the_end(replicas, requests)
    finally:
        replicas.close()
    assert len(results) == len(requests)
    for image in "abcd":
        holders = [engine for engine in engines if any(tag.startswith(image) for tag in engine.answered)]
        assert len(holders) == 1, f"image {image}'s requests went to {len(holders)} replicas"
    assert all(engine.answered for engine in engines)


def test_a_replica_busier_than_a_lookahead_window_gives_up_its_images_requests():
    engines = [FakeEngine(), FakeEngine()]
    replicas = EngineReplicas(iter(engines).__next__, count=2, threads_each=1)
    try:
        # One image's requests all at once, more than a window: the other replica takes some.
        results = run_to_the_end(replicas, [request(f"a{i}", "a") for i in range(20)])
    finally:
        replicas.close()
    assert len(results) == 20
    assert all(engine.answered for engine in engines)


def test_an_images_replica_keeps_its_requests_up_to_exactly_one_lookahead_window_busier():
    replicas = EngineReplicas(FakeEngine, count=2, threads_each=1)
    replicas.close()  # the choice alone, with no thread taking requests
    window = replicas.lookahead
    replicas._homes["a"] = 0
    home, other = replicas._replicas
    home.assigned, other.assigned = window, 0
    assert replicas._replica_for(request("x", "a")) == 0  # a window busier: still its image's replica
    home.assigned = window + 1
    assert replicas._replica_for(request("x", "a")) == 1


def test_an_exception_in_a_replica_reaches_the_caller():
    engines = [FakeEngine(fail_on="r3"), FakeEngine(fail_on="r3")]
    replicas = EngineReplicas(iter(engines).__next__, count=2, threads_each=1)
    try:
        with pytest.raises(RuntimeError, match="a bug while stepping r3"):
            run_to_the_end(replicas, [request(f"r{i}") for i in range(8)], timeout_s=10)
    finally:
        replicas.close()
    assert not any(
        thread.is_alive() for thread in threading.enumerate() if thread.name.startswith("batchvl-engine")
    )


def test_replica_count_and_shares(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert replica_count(EngineConfig(replicas=3), cpu, under_torchrun=False) == 3
    assert replica_count(EngineConfig(threads=2), cpu, under_torchrun=False) == min(2, os.cpu_count())
    assert replica_count(EngineConfig(threads=1), cpu, under_torchrun=False) == 1
    assert replica_count(EngineConfig(), cuda, under_torchrun=False) == 1
    assert replica_count(EngineConfig(replicas=3), cpu, under_torchrun=True) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a large machine: auto stops at 8
    assert replica_count(EngineConfig(threads=64), cpu, under_torchrun=False) == 8
    assert replica_count(EngineConfig(threads=5), cpu, under_torchrun=False) == 5
    # a job of a few requests: one engine under auto, and the count asked for otherwise
    assert replica_count(EngineConfig(threads=5), cpu, False, most_requests=31) == 1
    assert replica_count(EngineConfig(threads=5), cpu, False, most_requests=32) == 5
    assert replica_count(EngineConfig(threads=5), cpu, False, most_requests=None) == 5  # unknown: by cores
    assert replica_count(EngineConfig(replicas=3), cpu, False, most_requests=4) == 3
    # a model of more weights than replicas suit: one engine under auto, the count asked for otherwise
    large = MOST_WEIGHT_BYTES_FOR_REPLICAS + 1
    assert replica_count(EngineConfig(threads=5), cpu, False, weight_bytes=large) == 1
    assert replica_count(EngineConfig(threads=5), cpu, False, weight_bytes=large - 1) == 5
    assert replica_count(EngineConfig(replicas=3), cpu, False, weight_bytes=large) == 3
    share = replica_config(EngineConfig(encoder_cache_mb=512), 2)
    assert (share.kv_cache_mb, share.encoder_cache_mb) == (512, 256)  # auto's 1024 MiB on the CPU, halved
    assert replica_config(EngineConfig(kv_cache_mb=300), 3).kv_cache_mb == 100


def test_several_replicas_are_refused_where_one_engine_must_run():
    with pytest.raises(UserError, match="model.device is cuda; leave engine.replicas at auto"):
        replica_count(EngineConfig(replicas=3), torch.device("cuda", 0), under_torchrun=False)
    with pytest.raises(UserError, match="cannot be combined with engine.vit_parallel: data"):
        replica_count(EngineConfig(replicas=2, vit_parallel="data"), torch.device("cpu"), False)


def test_a_model_whose_rotary_embedding_rewrites_itself_gets_one_engine(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    cpu = torch.device("cpu")
    assert replica_count(EngineConfig(replicas=2), cpu, False, config) == 2  # mrope: static frequencies
    for kind in ("dynamic", "longrope"):
        config.text_config.rope_parameters = {**config.text_config.rope_parameters, "rope_type": kind}
        assert replica_count(EngineConfig(replicas=2), cpu, False, config) == 1, kind


def test_a_models_weights_are_counted_as_a_step_reads_them(loaded_fp32, tiny_model_dir):
    """Every weight of the checkpoint, at float32's 4 bytes, counted once, give or take the packing's own
    layout: the CPU's packed linear weights are buffers, not parameters."""
    from safetensors import safe_open

    from batchvl.engine.builder import weight_bytes

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as checkpoint:
        shapes = [checkpoint.get_slice(name).get_shape() for name in checkpoint.keys()]  # noqa: SIM118
    checkpoint_bytes = 4 * sum(math.prod(shape) for shape in shapes)
    assert checkpoint_bytes <= weight_bytes(loaded_fp32.adapter) <= 1.5 * checkpoint_bytes


def test_a_model_of_more_weights_than_replicas_suit_gets_one_engine(loaded_fp32, monkeypatch):
    from batchvl.engine import builder
    from batchvl.engine.parallel import replicas as module

    tokenizer, eos = loaded_fp32.processor.tokenizer, loaded_fp32.eos_token_ids()
    config = EngineConfig(threads=2, kv_cache_mb=8)
    engine = builder.build_engine(loaded_fp32.adapter, tokenizer, eos, config, most_requests=64)
    engine.close()
    assert engine.num_engines == min(2, os.cpu_count())
    monkeypatch.setattr(
        module, "MOST_WEIGHT_BYTES_FOR_REPLICAS", builder.weight_bytes(loaded_fp32.adapter) - 1
    )
    engine = builder.build_engine(loaded_fp32.adapter, tokenizer, eos, config, most_requests=64)
    engine.close()
    assert engine.num_engines == 1
