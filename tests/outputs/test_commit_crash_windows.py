"""A crash between any two steps of a shard's commit leaves the shard either committed with the file its
marker names, or uncommitted and redone by the next run; a committed shard written again stays committed,
with its old rows or its new ones. On a local folder and on S3 (moto's server).

A crash is an exception raised in place of one step (`Crash`, a BaseException, so that nothing on the way
out handles it): the steps before it happened, the ones after it did not, as when a run is killed there.
"""

import contextlib
import errno
import json
import os
import subprocess
import sys
import uuid

import pyarrow as pa
import pytest

from batchvl.config import job_config_from_dict
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.batch_output import batch_output_path, write_batch_output
from batchvl.outputs.commit import ShardMarker, commit_shard, marker_path, read_committed, read_marker
from batchvl.outputs.writers import ResultRow, output_path, parquet_bytes, rows_to_table
from batchvl.pipeline.commit_strategies import MergeIntoShard
from batchvl.pipeline.resume import plan_shards
from batchvl.storage.output_dir import LocalDir, open_output_dir

SHARD = ShardInfo("part-0.parquet", "/input/part-0.parquet", 2)
STEPS = ["output", "companion", "marker"]  # the commit's writes, in the order of the module's contract


class Crash(BaseException):
    """The run is killed here."""


@pytest.fixture(params=["local", "s3"])
def out(request, tmp_path):
    if request.param == "local":
        return LocalDir(str(tmp_path / "out"))
    endpoint, _ = request.getfixturevalue("s3")  # its bucket `data`, a new prefix per test
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    return open_output_dir(f"s3://data/commit-crash-{uuid.uuid4().hex}", options)


def result_row(index: int, text: str | None, status: str = "ok") -> ResultRow:
    error = "image_decode_error" if status == "error" else None
    return ResultRow(
        key=f"k{index}",
        sample_index=index,
        prompt="caption",
        prompt_index=0,
        text=text,
        status=status,
        error_type=error,
        error_message="cannot decode" if error else None,
        num_prompt_tokens=3,
        num_output_tokens=1,
        finish_reason="stop" if status == "ok" else None,
        num_images=1,
        latency_s=None,
    )


@contextlib.contextmanager
def crash_at(out, step: str):
    """Make the write of `step` ("output": the Parquet file, "companion": the batch API output, "marker")
    raise `Crash` instead of writing, for the body of the `with`, which must crash there."""
    where = {
        "output": output_path(out, SHARD.shard),
        "companion": batch_output_path(out, SHARD.shard),
        "marker": marker_path(out, SHARD.shard),
    }[step]
    write = out.write_bytes

    def write_or_crash(location: str, data: bytes) -> None:
        if location == where:
            raise Crash(step)
        write(location, data)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Crash):
        patch.setattr(out, "write_bytes", write_or_crash)  # write_text goes through it too
        yield


def commit(out, table: pa.Table) -> None:
    marker = ShardMarker.for_rows(SHARD.shard, [], {}, "f", task=None)
    marker.count(list(zip(table["status"].to_pylist(), table["error_type"].to_pylist(), strict=True)))
    companion = lambda shard, rows: write_batch_output(out, shard, rows, "tiny", 0)  # noqa: E731
    commit_shard(out, SHARD.shard, table, marker, companion)


def assert_uncommitted_and_redone_by_a_rerun(out) -> None:
    """No marker is left (it is written last, and a shard written again loses its old one first): never
    an old marker naming a new file, nor a new marker naming an old or a missing one, whatever their sizes
    are. The shard is not committed, and a rerun plans it."""
    assert out.size(marker_path(out, SHARD.shard)) is None
    assert read_marker(out, SHARD.shard) is None
    assert plan_shards(out, [SHARD], {}, "f", overwrite=False).pending == [SHARD]


def assert_committed(out, table: pa.Table) -> None:
    assert read_committed(out, SHARD.shard, read_marker(out, SHARD.shard)) == table
    lines = [json.loads(line) for line in out.read_text(batch_output_path(out, SHARD.shard)).splitlines()]
    assert [line["custom_id"] for line in lines] == table["key"].to_pylist()
    assert plan_shards(out, [SHARD], {}, "f", overwrite=False).pending == []


@pytest.mark.parametrize("step", STEPS)
def test_a_crash_before_a_new_shards_marker_leaves_it_uncommitted_and_a_rerun_commits_it(out, step):
    table = rows_to_table([result_row(0, "one"), result_row(1, "two")], {})
    with crash_at(out, step):
        commit(out, table)
    assert_uncommitted_and_redone_by_a_rerun(out)
    commit(out, table)
    assert_committed(out, table)


def assert_committed_rows(out, table: pa.Table) -> None:
    assert read_committed(out, SHARD.shard, read_marker(out, SHARD.shard)) == table


@pytest.mark.parametrize("step", STEPS)
def test_a_crash_while_a_committed_shard_is_rewritten_leaves_the_old_rows_or_the_new(out, step):
    # rows of the same byte size: only the marker's hash, not the file's size, tells the two files apart
    old = rows_to_table([result_row(0, "one"), result_row(1, "two")], {})
    new = rows_to_table([result_row(0, "uno"), result_row(1, "dos")], {})
    assert len(parquet_bytes(old)) == len(parquet_bytes(new))
    commit(out, old)
    with crash_at(out, step):
        commit(out, new)  # --overwrite
    # "marker" is its first write, the new marker naming the old one: the old file is still there
    assert_committed_rows(out, new if step == "companion" else old)
    commit(out, new)
    assert_committed(out, new)


@pytest.mark.parametrize("step", STEPS)
def test_a_crash_while_retry_failed_merges_rows_into_a_shard_leaves_the_old_rows_or_the_merged(out, step):
    job = job_config_from_dict(
        {
            "model": {"path": "models/tiny"},
            "input": {"paths": ["data/*.parquet"]},
            "prompts": [{"name": "caption", "text": "Describe this image."}],
            "output": {"dir": "out", "format": "openai_batch"},
        },
        "/",
    )
    commit(out, rows_to_table([result_row(0, "one"), result_row(1, None, "error")], {}))
    with crash_at(out, step):
        MergeIntoShard(job, out, ["preprocess.max_image_pixels=100000"])(SHARD, [result_row(1, "fixed")])
    texts = read_committed(out, SHARD.shard, read_marker(out, SHARD.shard))["text"].to_pylist()
    assert texts == (["one", "fixed"] if step == "companion" else ["one", None])


LIMIT = 1 << 16  # bytes a process may write to one file (RLIMIT_FSIZE): a write beyond it fails midway
CUT_SHORT = f"""
import resource, signal, sys
from batchvl.storage.output_dir import LocalDir
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    LocalDir(sys.argv[1]).write_bytes(sys.argv[2], bytes(range(256)) * {4 * LIMIT // 256})
except OSError as exc:
    print(exc.errno)
"""


@pytest.mark.parametrize("previous", [b"the committed file" * 100, None])
def test_a_local_write_cut_short_leaves_the_previous_file_whole_and_nothing_partial(tmp_path, previous):
    target = tmp_path / "part-0.parquet"
    if previous is not None:
        target.write_bytes(previous)
    written = subprocess.run(
        [sys.executable, "-c", CUT_SHORT, str(tmp_path), str(target)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert written.stdout.split() == [str(errno.EFBIG)]  # the write failed midway
    if previous is None:
        assert os.listdir(tmp_path) == []  # no partial file under the final name, no temp file
    else:
        assert os.listdir(tmp_path) == ["part-0.parquet"]
        assert target.read_bytes() == previous
