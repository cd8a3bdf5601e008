"""What identifies the version of an input file, recorded with each shard committed from it: a file
replaced under the same name (a refreshed dataset) has another stamp, and its shard is redone whole
rather than mixing rows of two files under the same keys.

A local file's stamp is what any write changes: its size, inode, and modification and change times (no
tool sets a change time back: `cp -p`, `rsync -t` and `tar x` keep a modification time, not a change time).
A shard's commit adds the content digest of the file it was made from (xxh3-128 of the whole file, read
once more once the shard's samples have all been read, while it is likely still in the page cache:
`ContentStamps`), if the file is still the one listed. A later stamp is then compared:
- another size or modification time: another file;
- the same, and the same inode and change time: the same file, without reading it;
- the same size and modification time, but another inode or change time (a file copied in place with its
  times kept, a `chmod`, a restore from a backup): the file is read and its digest decides. A same-sized
  file with the same modification time but other content is so told from a copy of the same file, which
  keeps its rows, and whose stamp a run records anew with the digest the comparison read.
A stamp taken within `checkpoint.RACY_S` of the file's last change is not trusted without reading it
(`checkpoint.settled`): a second write within the filesystem's timestamp tick could leave every time as it
was. Stamps recorded before digests were (size and modification time alone) are compared as they were
then.

An object's stamp is its size and the store's tag of its content or version (S3's ETag, GCS's generation,
...), as fsspec's `info()` gives it. A stamp is cheap, taken when the shards are listed, before any is read.

A `folder` shard is a recorded list of files: its stamp is each file's stamp, and a file gone from the
folder since is not a change (its rows stay, as a recorded shard's missing members' do), while a file
replaced under its name is.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future

from batchvl.config.checkpoint import file_digest, settled
from batchvl.inputs.types import ShardInfo
from batchvl.storage.remote import filesystem, is_remote

# An object's version, by the first of these its filesystem's `info()` gives (content tags first)
VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "VersionId", "mtime", "LastModified", "created")
STAT_KEYS = ("size", "mtime_ns", "ino", "ctime_ns")  # a local file's stamp
# The older stamp of a local file, and of a `folder` shard's files then ([size, modification time])
RECORDED_BEFORE_DIGESTS = ("size", "mtime_ns")
DIGEST = "xxh3"
READER_NAME = "batchvl-input-digests"  # `ContentStamps`' thread


def input_stamp(path: str, storage_options: dict) -> dict:
    if not is_remote(path):
        return file_stamp(path)
    fs, inner = filesystem(path, storage_options)
    info = fs.info(inner)
    version = next((key for key in VERSION_KEYS if info.get(key) is not None), None)
    stamp = {"size": info.get("size")}
    if version is not None:
        stamp[version] = str(info[version])
    return stamp


def file_stamp(path: str) -> dict:
    st = os.stat(path)
    return dict(zip(STAT_KEYS, (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns), strict=True))


def folder_stamp(folder: str, members: tuple[str, ...]) -> dict:
    """A folder shard's stamp: the stamp of each of its files still in the folder."""
    files = {}
    for member in members:
        try:
            files[member] = file_stamp(os.path.join(folder, member))
        except OSError:
            continue  # gone since the shard was recorded: not a change of what is there
    return {"files": files}


def with_content(listed: ShardInfo) -> dict | None:
    """The shard's stamp as listed, with the content digest of each local file it stamps where that file
    is still the one listed once read: what a commit records. A file changed since it was listed gets
    none, so that a stamp differing from the recorded one in inode or change time alone is taken as
    another file's."""
    stamp = listed.stamp
    if stamp is None:
        return None
    if "files" in stamp:
        files = stamp["files"]
        return {
            "files": {
                name: _digested(entry, os.path.join(listed.path, name)) for name, entry in files.items()
            }
        }
    return _digested(stamp, listed.path) if "ino" in stamp else stamp  # (an object's: its store's tag)


class ContentStamps:
    """A run's `with_content` of its shards, each read in a thread of its own once the shard's samples have
    all been read (its file likely still in the page cache), so that the commit, a few engine steps later,
    takes its stamp without reading the file on the job's thread, where a GPU would wait for it (a large
    file takes seconds to read from a network filesystem). The thread is a daemon: a run that stops exits
    at once, dropping a read under way (it writes nothing), where a pool's thread would be waited for, as
    long as a large file takes to read."""

    def __init__(self):
        self._started: dict[str, Future] = {}
        self._work: queue.SimpleQueue | None = None  # to the reading thread, once one is started

    def start(self, listed: ShardInfo) -> None:
        if listed.shard in self._started:
            return
        if self._work is None:
            self._work = queue.SimpleQueue()
            threading.Thread(target=_read, args=(self._work,), name=READER_NAME, daemon=True).start()
        self._started[listed.shard] = future = Future()
        self._work.put((listed, future))

    def of(self, listed: ShardInfo) -> dict | None:
        """The shard's stamp with its content (waited for, or read here where it was not started)."""
        started = self._started.pop(listed.shard, None)
        return started.result() if started is not None else with_content(listed)

    def close(self) -> None:
        """Drop the stamps not taken (a run stopped before their commits), and end the reading thread."""
        for future in self._started.values():
            future.cancel()
        self._started.clear()
        if self._work is not None:
            self._work.put(None)
            self._work = None


def _read(work: queue.SimpleQueue) -> None:
    """`ContentStamps`' thread: each (shard, future) given, until None."""
    while (item := work.get()) is not None:
        listed, future = item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(with_content(listed))
            except BaseException as error:  # handed to the commit that takes it
                future.set_exception(error)


def stamps_match(recorded: dict, listed: ShardInfo) -> bool:
    """Whether the input is the one a shard was committed from (`recorded`: its stamp then; `listed`: the
    shard now, its file read only where the stamps alone cannot tell); a folder shard's where every file
    still there is unchanged."""
    files = _file_entries(recorded, listed)
    if files is None:
        return recorded == listed.stamp
    return all(_same_file(old, new, path) for old, new, path in files)


def stands_for(recorded: dict, listed: ShardInfo) -> bool:
    """Whether `recorded`, a stamp that matches the shard as `listed` (`stamps_match`), tells so without
    reading its files: else a run records the listing's stamp with their digests in its place, so that
    they are not read at every plan (a copy kept in place, or a stamp taken too soon after a change).
    Stamps recorded before digests were are left as they are: replacing them would read every input."""
    files = _file_entries(recorded, listed)
    if files is None:
        return True  # an object's: its store's tag
    return all(old is None or "ino" not in old or _unchanged(old, new) for old, new, _ in files)


def _file_entries(recorded: dict, listed: ShardInfo) -> list[tuple[dict | None, dict, str]] | None:
    """(recorded entry, listed entry, path) of each local file the listed stamp stamps (a recorded entry
    from before digests as a dict; None: the file was not recorded), or None for an object's stamp."""
    current = listed.stamp
    if "files" in recorded and "files" in current:
        return [
            (_as_entry(recorded["files"].get(name)), entry, os.path.join(listed.path, name))
            for name, entry in current["files"].items()
        ]
    if "ino" in current:
        return [(_as_entry(recorded), current, listed.path)]
    return None


def _as_entry(recorded: dict | list | None) -> dict | None:
    """A file's recorded stamp as a dict: a folder's file recorded before digests was [size, mtime]."""
    if isinstance(recorded, list) and len(recorded) == len(RECORDED_BEFORE_DIGESTS):
        return dict(zip(RECORDED_BEFORE_DIGESTS, recorded, strict=True))
    return recorded if isinstance(recorded, dict) else None


def _same_file(recorded: dict | None, current: dict, path: str) -> bool:
    if recorded is None:
        return False  # not there when the shard was committed
    if any(recorded.get(key) != current[key] for key in RECORDED_BEFORE_DIGESTS):
        return False
    if "ino" not in recorded or _unchanged(recorded, current):
        return True  # (recorded before digests were: size and modification time, as then)
    digest = recorded.get(DIGEST)
    return digest is not None and _digested(current, path).get(DIGEST) == digest


def _unchanged(recorded: dict, current: dict) -> bool:
    """Whether a file's recorded stamp stands for it as it is now without reading it: trusted, and what any
    write changes the same."""
    return _trusted(recorded) and all(recorded[key] == current[key] for key in STAT_KEYS)


def _trusted(stamp: dict) -> bool:
    """Whether the stamp was taken long enough after its file's last change to stand for its content."""
    hashed = stamp.get("hashed_ns")
    return hashed is None or settled(hashed, stamp["mtime_ns"], stamp["ctime_ns"])


def _digested(stamp: dict, path: str) -> dict:
    """A local file's stamp with its content's digest, where the file read is still the one stamped. A
    file read for a trusted digest is not read again while its stamp is the same (`_READ`)."""
    key = (path, *(stamp[name] for name in STAT_KEYS))
    read = _READ.get(key)
    if read is None:
        hashed_ns = time.time_ns()
        digest = _digest_or_none(path)
        read = {DIGEST: digest, "hashed_ns": hashed_ns} if digest is not None else None
    if read is None or not _still(stamp, path):
        return stamp
    if _trusted({**stamp, **read}) and len(_READ) < READS_KEPT:
        _READ[key] = read
    return {**stamp, **read}


# The digests read in this process, by path and stamp, of files whose stamps were taken long enough after
# their last change to stand for their content (`_trusted`): a plan that read a copy kept in place to
# compare it records its stamp with that digest without reading it again, and a run's commit of a shard
# the plan read takes it too. A digest read sooner after a change is never kept: a second write in the
# same timestamp tick could change the content under the same stamp.
_READ: dict[tuple, dict] = {}
READS_KEPT = 65_536  # (a few hundred bytes each)


def _still(stamp: dict, path: str) -> bool:
    """Whether the file at `path` is still the one stamped."""
    try:
        return file_stamp(path) == {key: stamp[key] for key in STAT_KEYS}
    except OSError:
        return False


def _digest_or_none(path: str) -> str | None:
    try:
        return file_digest(path)
    except OSError:
        return None
