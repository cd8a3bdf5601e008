"""A plan reads its shards several at once in an object store's folder (`storage/reads_at_once.py`): each
read waits for the network, and one after the other a thousand shards' reads took minutes at every `run`.
The plan's side is tested on a local folder set to read as an object store's does, slowly and several at
once, and on a real S3 server's (moto's)."""

import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.commands.retry import retry_work
from batchvl.config import load_job_config
from batchvl.outputs.commit import read_input_stamp
from batchvl.pipeline import plan, resume
from batchvl.pipeline.plan import plan_job
from batchvl.pipeline.runner import run_job
from batchvl.storage import layout
from batchvl.storage.output_dir import LocalDir, RemoteDir
from batchvl.storage.reads_at_once import READS_AT_ONCE, each_at_once
from tests.conftest import caption_job_yaml, write_image_shards


def test_calls_run_side_by_side_and_their_results_keep_the_items_order():
    meeting = threading.Barrier(4, timeout=10)  # broken unless four calls wait at once

    def call(item: int) -> int:
        meeting.wait()
        return item * item

    assert each_at_once(call, range(8), at_once=4) == [item * item for item in range(8)]


def test_the_first_failure_in_the_items_order_is_raised_once_every_call_returned():
    called = []

    def call(item: int) -> int:
        time.sleep(0.05 if item == 2 else 0)  # the later failure ends first
        called.append(item)
        if item in (2, 5):
            raise ValueError(f"item {item}")
        return item

    with pytest.raises(ValueError, match="item 2"):
        each_at_once(call, range(8), at_once=4)
    assert sorted(called) == list(range(8))


class SlowCalls:
    """`directory`'s `method` (read_bytes, write_bytes) waiting for its answer as an object store's does,
    and the most calls it had under way at once."""

    def __init__(self, monkeypatch, directory=LocalDir, method="read_bytes"):
        self.lock, self.under_way, self.most = threading.Lock(), 0, 0
        call = getattr(directory, method)

        def slow_call(output_dir, *args):
            with self.lock:
                self.under_way += 1
                self.most = max(self.most, self.under_way)
            time.sleep(0.05)
            try:
                return call(output_dir, *args)
            finally:
                with self.lock:
                    self.under_way -= 1

        monkeypatch.setattr(directory, method, slow_call)


def one_at_a_time(function, items, at_once):
    return [function(item) for item in items]


def six_shards(folder) -> None:
    """Six one-sample shards, the last of which holds no image (an error row to retry)."""
    write_image_shards(folder, [1] * 6)
    pq.write_table(pa.table({"key": ["junk"], "image": [b"junk"]}), folder / "part-5.parquet")


@pytest.fixture
def committed_job(tmp_path, tiny_model_dir, loaded_fp32, monkeypatch):
    """A job of six committed shards in a local folder read as an object store's is, several at once."""
    six_shards(tmp_path / "data")
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    cfg = load_job_config(tmp_path / "job.yaml")
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    monkeypatch.setattr(LocalDir, "reads_at_once", READS_AT_ONCE)
    return cfg


def test_a_plan_reads_its_committed_shards_several_at_once(committed_job, monkeypatch):
    reads = SlowCalls(monkeypatch)
    planned = plan_job(
        committed_job, model_loaded=True
    )  # (as `status` and `validate` plan: nothing recorded)
    assert planned.resume.num_done == 6 and planned.resume.pending == []
    assert reads.most > 1


def test_a_runs_plan_records_what_its_markers_lack_several_shards_at_once(committed_job, monkeypatch):
    for stamp in (committed_job.output.dir / Path(layout.INPUT_STAMPS)).iterdir():
        stamp.unlink()  # (as shards committed before stamps were recorded)
    writes = SlowCalls(monkeypatch, method="write_bytes")
    planned = plan_job(committed_job, record=True, model_loaded=True)
    assert writes.most > 1
    out = LocalDir(committed_job.output.dir)
    assert all(read_input_stamp(out, name) is not None for name in planned.resume.done)


def test_a_retry_finds_its_shards_with_errors_several_at_once(committed_job, monkeypatch):
    for module in (resume, plan):
        monkeypatch.setattr(module, "each_at_once", one_at_a_time)
    reads = SlowCalls(monkeypatch)
    work = retry_work(committed_job, None, model_loaded=True)
    assert [shard.shard for shard in work.shards] == ["part-5.parquet"]
    assert reads.most > 1


def test_a_local_folder_is_read_one_shard_at_a_time(tmp_path, tiny_model_dir, loaded_fp32, monkeypatch):
    """A local read answers in microseconds: threads handing the interpreter to each other would cost more
    than they save (a plan of 500 local shards took longer so)."""
    six_shards(tmp_path / "data")
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    cfg = load_job_config(tmp_path / "job.yaml")
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    reads = SlowCalls(monkeypatch)
    plan_job(cfg, record=True, model_loaded=True)
    assert reads.most == 1


def test_an_object_stores_folder_is_planned_several_shards_at_once(
    tmp_path, tiny_model_dir, loaded_fp32, s3, monkeypatch
):
    endpoint, client = s3
    six_shards(tmp_path / "data")
    options = f"{{endpoint_url: '{endpoint}', key: testing, secret: testing}}"
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    cfg = load_job_config(
        tmp_path / "job.yaml", ["output.dir=s3://data/plans-at-once", f"output.storage_options={options}"]
    )
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    reads = SlowCalls(monkeypatch, RemoteDir)
    planned = plan_job(cfg, record=True, model_loaded=True)
    assert planned.resume.num_done == 6 and reads.most > 1


def test_a_runs_plan_reads_each_shards_recorded_stamp_once(committed_job, monkeypatch):
    """The stamp a shard's state was checked by is the one its record is made from: not read again."""
    read, stamps_read = LocalDir.read_bytes, []

    def counted(output_dir, location):
        if f"/{layout.INPUT_STAMPS}/" in location:
            stamps_read.append(Path(location).name)
        return read(output_dir, location)

    monkeypatch.setattr(LocalDir, "read_bytes", counted)
    plan_job(committed_job, record=True, model_loaded=True)
    assert sorted(stamps_read) == [f"part-{i}.json" for i in range(6)]
