"""A job's input keeps up with a busy engine thread: the workers' pixels cross as shared-memory files opened
by name (no descriptor fetched from the worker: `preprocess/shared_pixels.py`), and the GIL passes between
the input thread and the engine's every 1 ms, not Python's 5 (`utils/background.py`; the rates are
`benchmarks/input_rate.py`'s)."""

import multiprocessing.queues as queues
import sys
import time

import pytest

from batchvl.config import load_job_config
from batchvl.engine.engine import Engine
from batchvl.pipeline.runner import run_job
from batchvl.preprocess.pool import PreprocessPool
from batchvl.utils.background import HANDOFF_INTERVAL_S, prompt_handoffs
from tests.conftest import caption_job_yaml, output_rows, write_image_shards
from tests.preprocess.test_pool import collect, pixel_files, processor, shards  # noqa: F401 (a fixture)

SHARD_SIZES = [3, 2]


def received_messages(monkeypatch) -> list[bytes]:
    """The pickled messages this process's multiprocessing queues read (the pool's results among them)."""
    messages = []

    class Recording(queues._ForkingPickler):
        @classmethod
        def loads(cls, data, *args, **kwargs):
            messages.append(bytes(data))
            return super().loads(data, *args, **kwargs)

    monkeypatch.setattr(queues, "_ForkingPickler", Recording)
    return messages


def test_the_workers_pixels_arrive_as_shared_memory_files_opened_by_name(loaded_fp32, shards, monkeypatch):  # noqa: F811
    messages = received_messages(monkeypatch)
    source, infos = shards
    pool = PreprocessPool(source, infos, processor(loaded_fp32), 2, 2, 60)
    samples, _ = collect(pool)
    assert len(samples) == 12 and all(sample.error is None for sample in samples.values())
    sent = [message for message in messages if b"batchvl.preprocess.media" in message]
    assert len(sent) == 12 and all(b"_media_from_file" in message for message in sent)
    assert not any(b"rebuild_storage" in message for message in sent)  # no torch tensor in them
    assert pixel_files(pool) == []  # each removed as received


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    write_image_shards(tmp_path / "data", SHARD_SIZES)
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    return load_job_config(tmp_path / "job.yaml", [f"output.dir={tmp_path / 'out'}", "preprocess.workers=1"])


def test_the_engine_steps_with_prompt_handoffs_and_the_interval_comes_back(job, monkeypatch, tmp_path):
    before = sys.getswitchinterval()
    assert before > HANDOFF_INTERVAL_S  # Python's default, 5 ms
    seen = []
    step = Engine.step

    def recording(self):
        seen.append(sys.getswitchinterval())
        return step(self)

    monkeypatch.setattr(Engine, "step", recording)
    run_job(job, show_progress=False)
    assert seen and set(seen) == {HANDOFF_INTERVAL_S}
    assert sys.getswitchinterval() == before
    assert [row["status"] for row in output_rows(tmp_path / "out", len(SHARD_SIZES))] == ["ok"] * 5


def test_handoffs_restore_the_interval_after_an_error_and_never_lengthen_it():
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), prompt_handoffs(0.002):
        assert sys.getswitchinterval() == 0.002
        raise RuntimeError
    assert sys.getswitchinterval() == before
    sys.setswitchinterval(0.0005)
    try:
        with prompt_handoffs(0.002):
            assert sys.getswitchinterval() == 0.0005  # a shorter one the process set is kept
    finally:
        sys.setswitchinterval(before)


def test_between_two_steps_the_engine_gets_a_look_ahead_window_of_samples_not_a_workers_few(
    tmp_path, tiny_model_dir, monkeypatch
):
    """The run takes every ready sample, then steps while its input thread refills the feed: the feed holds
    the engine's look-ahead window (`runner.feed_size`), so that a slow step (a GPU's, with vision calls)
    is followed by as many new requests as the window has room for, not two a worker's."""
    write_image_shards(tmp_path / "data", [96])
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    overrides = [
        f"output.dir={tmp_path / 'out'}",
        "preprocess.workers=1",
        "engine.replicas=1",
        "engine.lookahead=32",
        "sampling.max_new_tokens=1",  # a request done in its first step: the window empties each step
    ]
    job = load_job_config(tmp_path / "job.yaml", overrides)
    events = []
    step, add_request = Engine.step, Engine.add_request

    def slow_step(self):
        events.append("step")
        time.sleep(0.5)  # the worker prepares more samples meanwhile
        return step(self)

    def counted(self, request):
        events.append("request")
        return add_request(self, request)

    monkeypatch.setattr(Engine, "step", slow_step)
    monkeypatch.setattr(Engine, "add_request", counted)
    run_job(job, show_progress=False)
    assert events.count("request") == 96
    between_steps = [len(run) for run in "".join("s" if e == "step" else "r" for e in events).split("s")]
    # the first window filled before the first step, and refilled whole after a step: a feed of two a
    # worker's (4) handed it 4 to 16 a step
    assert sum(count >= 28 for count in between_steps) >= 2, between_steps
    assert [row["status"] for row in output_rows(tmp_path / "out", 1)] == ["ok"] * 96
