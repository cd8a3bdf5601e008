"""What identifies the version of an input file, recorded with each shard committed from it: a file
replaced under the same name (a refreshed dataset) has another stamp, and its shard is redone whole
rather than mixing rows of two files under the same keys.

A local file's stamp is its size and modification time (what `make` and `rsync` compare); an object's,
its size and the store's tag of its content or version (S3's ETag, GCS's generation, ...), as fsspec's
`info()` gives it. A stamp is cheap, taken when the shards are listed, before any is read.

A `folder` shard is a recorded list of files: its stamp is each file's size and modification time, and a
file gone from the folder since is not a change (its rows stay, as a recorded shard's missing members'
do), while a file replaced under its name is.
"""

from __future__ import annotations

import os

from batchvl.storage.remote import filesystem, is_remote

# An object's version, by the first of these its filesystem's `info()` gives (content tags first)
VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "VersionId", "mtime", "LastModified", "created")


def input_stamp(path: str, storage_options: dict) -> dict:
    if not is_remote(path):
        st = os.stat(path)
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    fs, inner = filesystem(path, storage_options)
    info = fs.info(inner)
    version = next((key for key in VERSION_KEYS if info.get(key) is not None), None)
    stamp = {"size": info.get("size")}
    if version is not None:
        stamp[version] = str(info[version])
    return stamp


def folder_stamp(folder: str, members: tuple[str, ...]) -> dict:
    """A folder shard's stamp: size and modification time of each of its files still in the folder."""
    files = {}
    for member in members:
        try:
            st = os.stat(os.path.join(folder, member))
        except OSError:
            continue  # gone since the shard was recorded: not a change of what is there
        files[member] = [st.st_size, st.st_mtime_ns]
    return {"files": files}


def stamps_match(recorded: dict, current: dict) -> bool:
    """Whether the input is the one a shard was committed from: equal stamps, or for a folder shard every
    file still there unchanged."""
    if "files" in recorded and "files" in current:
        return all(recorded["files"].get(name) == entry for name, entry in current["files"].items())
    return recorded == current
