"""A committed shard records the input file it was made from: replaced under the same name (other images,
more rows), the shard is run again whole, never kept in part, and `status` says so rather than
'complete'. Real jobs on the tiny model."""

import os
import shutil
import subprocess
import sys
import threading
import time

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from batchvl.commands.labels import job_rows
from batchvl.commands.status import format_status, job_status
from batchvl.config import checkpoint, load_job_config
from batchvl.errors import UserError
from batchvl.inputs import stamps
from batchvl.inputs.stamps import folder_stamp, input_stamp, stamps_match, stands_for, with_content
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.commit import read_input_stamp
from batchvl.pipeline.runner import run_job
from batchvl.storage.output_dir import LocalDir
from tests.conftest import caption_job_yaml, output_rows, png_bytes, random_image, write_image_shards

CAPTION = "{name: caption, text: Describe this image.}"
SHORT = "{name: short, text: One word.}"


@pytest.fixture
def job_dir(tmp_path, tiny_model_dir):
    write_image_shards(tmp_path / "data", [2, 3])
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    return tmp_path


def config(job_dir, out: str, *overrides: str):
    return load_job_config(job_dir / "job.yaml", [f"output.dir={out}", *overrides])


def replace_first_shard(job_dir) -> None:
    """part-0.parquet written again: other images under the same keys, and two more samples."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = [png_bytes(random_image(50 + 5 * i, 70, seed=100 + i)) for i in range(4)]
    keys = [f"s0-{i}" for i in range(4)]
    pq.write_table(pa.table({"key": keys, "image": images}), job_dir / "data" / "part-0.parquet")


def test_a_replaced_input_file_is_run_again_whole_with_an_added_prompt(job_dir, loaded_fp32):
    run_job(config(job_dir, "out"), loaded=loaded_fp32, show_progress=False)
    replace_first_shard(job_dir)
    added = f"prompts=[{CAPTION}, {SHORT}]"
    status = job_status(config(job_dir, "out", added))
    assert status.shards_done == 0 and status.missing_tasks == [0]  # part-1 is run for its new prompt
    text = format_status(status, "job.yaml")
    assert "1 shard(s) were committed from input files that changed since" in text
    assert "complete" not in text
    assert "short: 3 row(s) reused" not in text and "caption: 3 row(s) reused, 4 to compute" in text
    with pytest.raises(UserError, match=r"1 shard\(s\) committed from input files that changed since"):
        job_rows(config(job_dir, "out"))  # a reader does not hand out the replaced file's rows
    rerun = run_job(config(job_dir, "out", added), loaded=loaded_fp32, show_progress=False)
    assert rerun.stats["shards_committed"] == 2
    run_job(config(job_dir, "fresh", added), loaded=loaded_fp32, show_progress=False)
    rows = output_rows(job_dir / "out", 2)
    assert len(rows) == 2 * (4 + 3)
    assert rows == output_rows(job_dir / "fresh", 2)
    stamp = read_input_stamp(LocalDir(str(job_dir / "out")), "part-0.parquet")
    path = job_dir / "data" / "part-0.parquet"
    assert stamp.items() >= input_stamp(str(path), {}).items()  # the new file's, with its content's digest
    assert stamp["xxh3"] == xxhash.xxh3_128_hexdigest(path.read_bytes())
    again = run_job(config(job_dir, "out", added), loaded=loaded_fp32, show_progress=False)
    assert again.stats["shards_skipped"] == 2  # the new file's stamp recorded: done


def test_an_object_replaced_in_a_store_has_another_stamp():
    fs = fsspec.filesystem("memory")
    fs.pipe("/stamps/part-0.parquet", b"one")
    before = input_stamp("memory://stamps/part-0.parquet", {})
    assert input_stamp("memory://stamps/part-0.parquet", {}) == before
    fs.pipe("/stamps/part-0.parquet", b"two")
    assert input_stamp("memory://stamps/part-0.parquet", {}) != before


# A time long past, which a replacement keeps (`cp -p`, `rsync -t`, `tar x` set a file's modification time)
KEPT_MTIME_NS = 1_600_000_000_123_456_789


def write_kept(path, data: bytes) -> None:
    """`data` written to a new file moved over `path`, with `path`'s modification time as a copy keeps it."""
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    os.utime(new, ns=(KEPT_MTIME_NS, KEPT_MTIME_NS))
    os.replace(new, path)


def listed(path) -> ShardInfo:
    return ShardInfo(path.name, str(path), None, stamp=input_stamp(str(path), {}))


@pytest.fixture
def committed(tmp_path, monkeypatch):
    """A file listed and its stamp recorded as a commit records it; stamps are trusted at once (a stamp
    taken within seconds of its file's change is read every time: its own test)."""
    monkeypatch.setattr(checkpoint, "RACY_S", 0.0)
    path = tmp_path / "part-0.tar"
    write_kept(path, b"a" * 1000)
    return path, with_content(listed(path))


def test_a_file_replaced_by_one_of_the_same_size_and_times_is_another_input(committed):
    path, recorded = committed
    write_kept(path, b"b" * 1000)
    now = listed(path)
    assert (now.stamp["size"], now.stamp["mtime_ns"]) == (1000, KEPT_MTIME_NS)  # what the old stamp compared
    assert not stamps_match(recorded, now)


def test_an_edit_in_place_that_sets_the_modification_time_back_is_another_input(committed):
    path, recorded = committed
    with open(path, "r+b") as file:
        file.seek(500)
        file.write(b"b")
    os.utime(path, ns=(KEPT_MTIME_NS, KEPT_MTIME_NS))
    assert listed(path).stamp["ino"] == recorded["ino"]
    assert not stamps_match(recorded, listed(path))


def test_a_copy_kept_in_place_is_the_same_input_read_once_then_recorded_anew(committed, monkeypatch):
    path, recorded = committed
    write_kept(path, path.read_bytes())  # a restore from a backup: another inode, the same bytes
    os.chmod(path, 0o640)
    now = listed(path)
    assert now.stamp["ino"] != recorded["ino"] and stamps_match(recorded, now)
    assert not stands_for(recorded, now)  # told by reading it: a run records its stamp anew
    again = with_content(now)
    assert stands_for(again, now)
    monkeypatch.setattr(stamps, "_digest_or_none", unreadable)
    assert stamps_match(again, now)  # not read


def unreadable(path):
    raise AssertionError(f"{path} was read")


def counted_reads(monkeypatch) -> list[str]:
    """The paths whose content is read for a digest from now on, in order."""
    reads, digest = [], stamps.file_digest

    def read(path):
        reads.append(os.path.basename(path))
        return digest(path)

    monkeypatch.setattr(stamps, "file_digest", read)
    return reads


def test_a_copy_kept_in_place_is_read_once_to_compare_it_and_record_its_stamp(committed, monkeypatch):
    """A plan compares a copy kept in place by reading it, then records its new stamp with the digest it
    read: a dataset restored from a backup is read once at the next run's plan, not twice."""
    path, recorded = committed
    write_kept(path, path.read_bytes())
    reads = counted_reads(monkeypatch)
    now = listed(path)
    assert stamps_match(recorded, now) and not stands_for(recorded, now)
    restamped = with_content(now)
    assert restamped["xxh3"] == recorded["xxh3"] and stands_for(restamped, now)
    assert reads == [path.name]


def test_a_digest_read_right_after_its_files_change_does_not_stand_for_it_later(tmp_path, monkeypatch):
    """A digest read within seconds of its file's change is not kept for its stamp: a second write in the
    same timestamp tick, leaving every time as it was, is then seen by reading the file again."""
    path = tmp_path / "part-0.tar"
    write_kept(path, b"a" * 1000)  # changed just now
    first = listed(path)
    recorded = with_content(first)
    assert "xxh3" in recorded
    with open(path, "r+b") as file:
        file.write(b"b")
    monkeypatch.setattr(stamps, "file_stamp", lambda _: dict(first.stamp))  # every time as it was
    assert not stamps_match(recorded, first)


def test_an_unchanged_file_is_not_read(committed, monkeypatch):
    path, recorded = committed
    monkeypatch.setattr(stamps, "_digest_or_none", unreadable)
    assert stamps_match(recorded, listed(path)) and stands_for(recorded, listed(path))


def test_a_stamp_taken_right_after_its_files_change_is_read_every_time(tmp_path):
    path = tmp_path / "part-0.tar"
    write_kept(path, b"a" * 1000)  # changed just now
    recorded = with_content(listed(path))
    assert not stands_for(recorded, listed(path)) and stamps_match(recorded, listed(path))
    with open(path, "r+b") as file:
        file.write(b"b")
    # a second write within the filesystem's timestamp tick: every time and the inode as they were
    unchanged = {key: recorded[key] for key in stamps.STAT_KEYS}
    assert not stamps_match(recorded, ShardInfo(path.name, str(path), None, stamp=unchanged))


def test_a_file_changed_between_its_listing_and_the_commit_gets_no_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "RACY_S", 0.0)
    path = tmp_path / "part-0.tar"
    write_kept(path, b"a" * 1000)
    before = listed(path)
    write_kept(path, b"b" * 1000)  # the rows may be the old file's or the new one's
    recorded = with_content(before)
    assert "xxh3" not in recorded and recorded == before.stamp
    assert not stamps_match(recorded, listed(path))


def test_a_folder_shards_file_replaced_with_the_same_size_and_times_is_a_change(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "RACY_S", 0.0)
    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("a.png", "b.png"):
        write_kept(folder / name, name.encode() * 100)

    def shard() -> ShardInfo:
        return ShardInfo(
            "images",
            str(folder),
            None,
            ("a.png", "b.png", "c.png"),
            stamp=folder_stamp(str(folder), ("a.png", "b.png", "c.png")),
        )

    recorded = with_content(shard())
    (folder / "a.png").unlink()  # gone since: no change of what is there
    write_kept(folder / "b.png", (folder / "b.png").read_bytes())  # copied in place
    assert stamps_match(recorded, shard())
    write_kept(folder / "b.png", b"x" * 500)
    assert not stamps_match(recorded, shard())
    write_kept(folder / "b.png", b"b.png" * 100)
    write_kept(folder / "c.png", b"new")  # not there when the shard was committed
    assert not stamps_match(recorded, shard())


def test_stamps_recorded_before_digests_are_compared_by_size_and_modification_time(committed):
    path, _ = committed
    write_kept(path, b"b" * 1000)
    assert stamps_match({"size": 1000, "mtime_ns": KEPT_MTIME_NS}, listed(path))
    assert not stamps_match({"size": 1000, "mtime_ns": KEPT_MTIME_NS + 1}, listed(path))
    old_folder = {"files": {path.name: [1000, KEPT_MTIME_NS]}}
    shard = ShardInfo(
        "data", str(path.parent), None, (path.name,), stamp=folder_stamp(str(path.parent), (path.name,))
    )
    assert stamps_match(old_folder, shard) and stands_for(old_folder, shard)  # not read again


def test_a_parquet_shard_edited_in_place_with_its_size_and_time_kept_is_run_again(
    job_dir, loaded_fp32, monkeypatch
):
    """The end to end case: a key's bytes changed where the file keeps its size and modification time."""
    monkeypatch.setattr(checkpoint, "RACY_S", 0.0)  # stamps trusted at once: a plan reads only what it must
    path = job_dir / "data" / "part-0.parquet"
    images = [png_bytes(random_image(50, 70, seed=100 + i)) for i in range(2)]
    pq.write_table(pa.table({"key": ["s0-0", "s0-1"], "image": images}), path, compression="none")
    run_job(config(job_dir, "out"), loaded=loaded_fp32, show_progress=False)
    st = os.stat(path)
    data = path.read_bytes()
    assert data.count(b"s0-1") >= 1
    path.write_bytes(data.replace(b"s0-1", b"s0-7"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    rerun = run_job(config(job_dir, "out"), loaded=loaded_fp32, show_progress=False)
    assert rerun.stats["shards_committed"] == 1
    keys = pq.read_table(job_dir / "out" / "part-0.parquet")["key"].to_pylist()
    assert sorted(keys) == ["s0-0", "s0-7"]
    kept = shutil.copy2(path, path.with_suffix(".copy"))  # a copy kept in place: its rows stay
    os.replace(kept, path)
    reads = counted_reads(monkeypatch)
    again = run_job(config(job_dir, "out"), loaded=loaded_fp32, show_progress=False)
    assert again.stats["shards_skipped"] == 2
    assert reads == ["part-0.parquet"]  # the copy, once; part-1.parquet is as it was recorded
    recorded = read_input_stamp(LocalDir(str(job_dir / "out")), "part-0.parquet")
    assert recorded["ino"] == os.stat(path).st_ino  # recorded anew: the next plan does not read the copy


def test_a_runs_commits_take_their_inputs_digests_read_beside_the_jobs_thread(
    job_dir, loaded_fp32, monkeypatch
):
    """Reading a shard's file for its digest on the job's thread would hold the engine's next step (a GPU
    idle meanwhile): the run reads it in a thread of its own, once the shard's samples are all read."""
    readers = []
    digest = stamps.file_digest

    def recorded(path):
        readers.append((os.path.basename(path), threading.get_ident()))
        return digest(path)

    monkeypatch.setattr(stamps, "file_digest", recorded)
    run_job(config(job_dir, "out"), loaded=loaded_fp32, show_progress=False)
    assert sorted(name for name, _ in readers) == ["part-0.parquet", "part-1.parquet"]
    assert threading.get_ident() not in {reader for _, reader in readers}
    recorded_stamp = read_input_stamp(LocalDir(str(job_dir / "out")), "part-1.parquet")
    assert recorded_stamp["xxh3"] == digest(str(job_dir / "data" / "part-1.parquet"))


def test_content_stamps_not_started_are_read_when_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "RACY_S", 0.0)
    path = tmp_path / "part-0.tar"
    write_kept(path, b"a" * 1000)
    content = stamps.ContentStamps()
    try:
        taken = content.of(listed(path))
        assert taken.items() >= listed(path).stamp.items()
        assert taken["xxh3"] == xxhash.xxh3_128_hexdigest(path.read_bytes())
    finally:
        content.close()


# A run that stops while its input's digest is being read: the read (made to take minutes here, as a large
# file on a slow filesystem would) is dropped at the process's exit, not waited for
STOPPED_DURING_A_READ = """
import time
from batchvl.inputs import stamps
from batchvl.inputs.types import ShardInfo
stamps.with_content = lambda listed: time.sleep(300)
content = stamps.ContentStamps()
content.start(ShardInfo("part-0.tar", "/nowhere/part-0.tar", None, stamp={}))
time.sleep(0.5)
content.close()
"""


def test_a_run_that_stops_exits_without_waiting_for_a_digest_under_way():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STOPPED_DURING_A_READ], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 60
