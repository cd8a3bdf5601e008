"""The identity of the checkpoint at `model.path`, part of what defines the output: a content digest of
its files in three parts, so a change in place is named by what it changed. `model.path` names a folder,
not what is in it: new weights, an edited chat template or a changed `image_mean` under the same path
change every row, as a changed `model.dtype` does.

Each part hashes whole files (xxh3-128), so an edit that keeps a file's size and its modification time
is still seen. Hashing a checkpoint of many GB at every plan (`run`, `validate`, `status`, each Slurm
task) would cost seconds to minutes, so each file's digest is remembered in a small file under the
user's cache folder, keyed by what any write changes (size, inode, modification and change times: no
tool sets a change time back), and computed again when one of them differs. A file written within the
last seconds is not remembered, since a filesystem's coarse timestamps could hide a second write in the
same tick. A remembered file that cannot be read, or does not hold what it should, is ignored.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import time

import xxhash

# The parts of a checkpoint, each named in the refusal of a change, by the file names that make it
PARTS = {
    "weights": ("*.safetensors", "*.bin", "*.index.json", "config.json", "generation_config.json"),
    "tokenizer": (
        "tokenizer*.json",
        "tokenizer.model",
        "vocab.*",
        "merges.txt",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.*",
        "additional_chat_templates/*.jinja",
    ),
    "processor": ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"),
}
# What a change of each part is, in a refusal's words
PART_NAMES = {
    "weights": "weights or model config",
    "tokenizer": "tokenizer or chat template",
    "processor": "processor config",
}
# A file changed this recently may change again within its filesystem's timestamp tick, leaving its times as
# they were: a stamp of its times taken then does not stand for its content (`settled`)
RACY_S = 3.0
_DIGEST = re.compile("[0-9a-f]{32}")
_PIECE = 16 << 20


def checkpoint_identity(path: str) -> dict[str, str] | None:
    """Per part of the checkpoint folder at `path`, the digest of its files (names and contents); None
    where `path` is not a local folder (a model the server names, or a path that does not exist)."""
    if not os.path.isdir(path):
        return None
    folder = os.path.abspath(path)
    files = _checkpoint_files(folder)
    remembered_at = _remembered_path(folder)
    remembered = _read_remembered(remembered_at)
    digests, stamps = {}, {}
    for name in sorted({name for names in files.values() for name in names}):
        stamps[name], digests[name] = _stamped_digest(os.path.join(folder, name), remembered.get(name))
    entries = {name: [*stamps[name], digests[name]] for name in digests if stamps[name]}
    if entries != remembered:
        _remember(remembered_at, entries)
    return {part: _part_digest(names, digests) for part, names in files.items()}


def _checkpoint_files(folder: str) -> dict[str, list[str]]:
    """The folder's files of each part, as paths relative to it (a file in no part changes no row)."""
    names = [entry.name for entry in os.scandir(folder) if entry.is_file()]
    extra = os.path.join(folder, "additional_chat_templates")
    if os.path.isdir(extra):
        names += [f"additional_chat_templates/{entry.name}" for entry in os.scandir(extra) if entry.is_file()]
    return {
        part: sorted(name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns))
        for part, patterns in PARTS.items()
    }


def _part_digest(names: list[str], digests: dict[str, str]) -> str:
    digest = xxhash.xxh3_128()
    for name in names:
        digest.update(f"{name}\0{digests[name]}\0".encode())
    return digest.hexdigest()


def _stamped_digest(path: str, remembered: list | None) -> tuple[list[int], str]:
    """(the file's stamp, or [] when it is too fresh to remember; its content digest)."""
    st = os.stat(path)
    stamp = [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    if remembered is not None and remembered[:4] == stamp:
        return stamp, remembered[4]
    digest = file_digest(path)
    return (stamp if settled(time.time_ns(), st.st_mtime_ns, st.st_ctime_ns) else []), digest


def settled(read_ns: int, mtime_ns: int, ctime_ns: int) -> bool:
    """Whether a file read at `read_ns` had been left alone long enough (RACY_S) after its last change for
    its times to stand for the content read. Input stamps use it too."""
    return read_ns - max(mtime_ns, ctime_ns) >= RACY_S * 1e9


def file_digest(path: str) -> str:
    """The hex xxh3-128 digest of the whole file at `path`, read in large pieces (some GB a second, far
    faster than the disks it reads); raises OSError where it cannot be read. Input stamps use it too."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        while piece := file.read(_PIECE):
            digest.update(piece)
    return digest.hexdigest()


def _remembered_path(folder: str) -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "batchvl", "checkpoints", xxhash.xxh3_64_hexdigest(folder.encode()) + ".json")


def _read_remembered(path: str) -> dict[str, list]:
    """The remembered digests of a checkpoint's files, by name: only entries of the expected form (four
    integers and a digest), so a damaged or foreign file costs a hash, never a wrong identity."""
    try:
        with open(path) as file:
            entries = json.load(file)
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict):
        return {}
    return {name: entry for name, entry in entries.items() if _well_formed(entry)}


def _well_formed(entry) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 5
        and all(type(value) is int for value in entry[:4])
        and isinstance(entry[4], str)
        and _DIGEST.fullmatch(entry[4]) is not None
    )


def _remember(path: str, entries: dict[str, list]) -> None:
    with contextlib.suppress(OSError):  # not remembered: hashed again next time
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as file:
            json.dump(entries, file)
        os.replace(temporary, path)
