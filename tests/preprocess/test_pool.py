"""The preprocessing pool: every sample exactly once, and a crashing or hanging worker costs one sample."""

import io
import os
import resource
import threading
import time

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchvl.preprocess.pool as pool_module
import batchvl.preprocess.qwen_vision as qwen_vision
from batchvl.config import InputConfig, PromptConfig
from batchvl.inputs.parquet import ParquetSource
from batchvl.inputs.types import ShardEnd
from batchvl.preprocess import shared_pixels
from batchvl.preprocess.pool import PreprocessPool
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.qwen_vision import QwenMediaPreparer, QwenVisionSpec
from batchvl.preprocess.sample import PreparedSample, SampleProcessor
from batchvl.preprocess.video import FrameSampling
from tests.conftest import random_image
from tests.preprocess.test_shared_pixels import a_gone_pid


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(30 + seed % 7, 40, seed).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture()
def shards(tmp_path):
    for name, seeds in (("a.parquet", range(0, 7)), ("b.parquet", range(7, 12))):
        pq.write_table(
            pa.table({"image": [png(s) for s in seeds], "id": [f"s{s}" for s in seeds]}), tmp_path / name
        )
    source = ParquetSource(InputConfig(paths=[str(tmp_path / "*.parquet")], key_column="id"))
    return source, source.list_shards()


def processor(loaded):
    spec = QwenVisionSpec.from_image_processor(loaded.processor.image_processor)
    prompts = [PromptConfig("caption", "Describe."), PromptConfig("ask", "Is it {key}?")]
    media = QwenMediaPreparer(spec, FrameSampling(2.0, 4, 16), 10**7, 10**8)
    return SampleProcessor(PromptRenderer(loaded.processor), media, prompts)


def collect(pool):
    samples, ends = {}, {}
    for item in pool:
        if isinstance(item, ShardEnd):
            assert item.shard not in ends
            ends[item.shard] = item.num_samples
        else:
            assert isinstance(item, PreparedSample)
            assert (item.shard, item.index) not in samples, "a sample came out twice"
            samples[(item.shard, item.index)] = item
    return samples, ends


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_every_sample_exactly_once(loaded_fp32, shards, workers):
    source, infos = shards
    samples, ends = collect(PreprocessPool(source, infos, processor(loaded_fp32), workers, 2, 60))
    assert ends == {"a.parquet": 7, "b.parquet": 5}
    assert sorted(samples) == [("a.parquet", i) for i in range(7)] + [("b.parquet", i) for i in range(5)]
    for sample in samples.values():
        assert sample.error is None and len(sample.images) == 1
        assert [p.error for p in sample.prompts] == [None, None]
    # the prompt template used the sample's field: prompts differ per sample
    asks = {tuple(s.prompts[1].prompt) for s in samples.values()}
    assert len(asks) == len(samples)


@pytest.fixture()
def poisoned(monkeypatch):
    """Decoding the 3rd image of shard a crashes its worker; the 2nd of shard b hangs."""
    crash, hang = png(2), png(8)
    real_decode = qwen_vision.decode_image

    def decode(data, path, limit):
        if data == crash:
            os._exit(11)  # like a segfault in a native decoder: the process is gone
        if data == hang:
            time.sleep(3600)
        return real_decode(data, path, limit)

    # Workers are forked, so they inherit the patched function.
    monkeypatch.setattr(qwen_vision, "decode_image", decode)


def test_crashing_and_hanging_samples_cost_only_themselves(loaded_fp32, shards, poisoned):
    source, infos = shards
    pool = PreprocessPool(source, infos, processor(loaded_fp32), workers=2, prefetch=2, timeout_s=2)
    samples, ends = collect(pool)
    assert ends == {"a.parquet": 7, "b.parquet": 5}
    assert len(samples) == 12
    errors = {k: s.error.error_type for k, s in samples.items() if s.error is not None}
    assert errors == {("a.parquet", 2): "preprocess_crash", ("b.parquet", 1): "preprocess_timeout"}
    assert samples[("a.parquet", 2)].key == "s2"  # the error row still carries the sample's key
    assert "preprocess.timeout_s=2" in samples[("b.parquet", 1)].error.message
    assert pool.stats.worker_restarts in (1, 2)  # both may be noticed in the same restart
    assert (pool.stats.samples_crashed, pool.stats.samples_timed_out) == (1, 1)


def pixel_files(pool: PreprocessPool) -> list:
    """The files of the pool's workers' pixels that are still in shared memory."""
    return list(shared_pixels.SHM_DIR.glob(f"{pool.pixels_prefix}-*"))


def test_samples_sent_and_never_received_leave_no_pixel_files(loaded_fp32, shards):
    """A job that stops while its workers have samples on the way: their pixels' files go with the pool."""
    source, infos = shards
    pool = PreprocessPool(source, infos, processor(loaded_fp32), workers=2, prefetch=2, timeout_s=60)
    items = iter(pool)
    next(items)
    deadline = time.monotonic() + 30
    while not pixel_files(pool):  # the workers prepare the next samples and send them
        assert time.monotonic() < deadline, "no sample was sent after the first"
        time.sleep(0.01)
    lock = shared_pixels.SHM_DIR / f"{pool.pixels_prefix}{shared_pixels.LOCK_SUFFIX}"
    assert lock.exists()  # held while the pool iterates: its job is alive
    items.close()  # the job stops reading
    assert pixel_files(pool) == [] and not lock.exists()


def test_a_pool_removes_the_pixel_files_a_killed_job_left_behind(loaded_fp32, shards):
    left = shared_pixels.SHM_DIR / f"{shared_pixels.PREFIX}-{a_gone_pid()}-0badf00d-1-1"
    left.write_bytes(b"pixels")
    old = time.time() - shared_pixels.LEFT_BEHIND_AFTER_S - 60
    os.utime(left, (old, old))
    source, infos = shards
    try:
        collect(PreprocessPool(source, infos, processor(loaded_fp32), workers=1, prefetch=2, timeout_s=60))
        assert not left.exists()
    finally:
        left.unlink(missing_ok=True)


def is_gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_worker_dying_while_it_sends_a_result_does_not_hang_the_pool(loaded_fp32, tmp_path, monkeypatch):
    """A worker's queue thread sends results while the worker goes on; a crash then cuts a message."""
    big = io.BytesIO()
    random_image(600, 600, 1).save(big, format="PNG")  # ~1 MB of pixel values: more than a pipe holds
    images = [png(0), big.getvalue(), png(2), png(3)]
    real_decode = qwen_vision.decode_image

    def decode(data, path, limit):
        if data == images[2]:
            os._exit(11)
        return real_decode(data, path, limit)

    monkeypatch.setattr(qwen_vision, "decode_image", decode)
    pq.write_table(pa.table({"image": images, "id": ["s0", "s1", "s2", "s3"]}), tmp_path / "a.parquet")
    source = ParquetSource(InputConfig(paths=[str(tmp_path / "a.parquet")], key_column="id"))
    pool = PreprocessPool(source, source.list_shards(), processor(loaded_fp32), 1, 2, 60)
    before = {process.pid for process in psutil.Process().children()}
    items = iter(pool)
    first = next(items)
    # Not reading now: the worker's queue thread blocks halfway through sending the big sample into the
    # full pipe while the worker itself moves on and dies on the next one. Wait until it has died.
    workers = [process for process in psutil.Process().children() if process.pid not in before]
    assert workers, "the pool runs its worker in a process"
    deadline = time.monotonic() + 60
    while not all(is_gone(worker) for worker in workers):
        assert time.monotonic() < deadline, "the worker never reached the crashing sample"
        time.sleep(0.01)
    rest = []
    reader = threading.Thread(target=lambda: rest.extend(items), daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "the pool hung on a half-sent result"
    samples = {i.index: i for i in [first, *rest] if isinstance(i, PreparedSample)}
    assert sorted(samples) == [0, 1, 2, 3]
    assert samples[2].error.error_type == "preprocess_crash"
    assert all(samples[i].error is None for i in (0, 1, 3))


def test_a_sample_that_cannot_reach_the_job_process_is_its_error_row_not_a_hang(
    loaded_fp32, shards, monkeypatch
):
    """A full /dev/shm or a file size limit (`ulimit -f`) failed the pixels' move to shared memory in the
    result queue's feeder thread, which printed the error and dropped the sample: the job waited forever."""
    real_init = pool_module._init_worker

    def limited(*args):
        real_init(*args)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    monkeypatch.setattr(pool_module, "_init_worker", limited)  # in the workers only: they are forked
    source, infos = shards
    found = []
    reader = threading.Thread(
        target=lambda: found.append(collect(PreprocessPool(source, infos, processor(loaded_fp32), 2, 2, 60))),
        daemon=True,
    )
    reader.start()
    reader.join(timeout=120)
    assert not reader.is_alive(), "the pool waited for samples its workers could not send"
    ((samples, ends),) = found
    assert ends == {"a.parquet": 7, "b.parquet": 5} and len(samples) == 12
    for sample in samples.values():
        assert sample.error.error_type == "preprocess_error"
        assert sample.error.message.startswith("the prepared sample could not be put in shared memory")
        assert "File too large" in sample.error.message and sample.key.startswith("s")
