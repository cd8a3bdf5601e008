"""What the encoder disk cache's folder holds, and the only files the cache ever counts, trims or removes.

    <folder>/BATCHVL_ENCODER_CACHE              the marker: this folder is an encoder cache, of this layout
    <folder>/<key[:2]>/<key>.emb                an entry (`disk_entry.py`); a key is 32 hexadecimal digits
    <folder>/digests/<32 hex digits>            a remembered vision digest (`vision_digest.py`)
    <name>.<pid>.<32 hex digits>.tmp            a file above being written, beside it

The folder is a user's setting, so it may be pointed at a folder that holds other files. The cache writes
its marker into a folder that holds none of them (a new or empty folder, or the folder of a cache that an
earlier version wrote before there was a marker: every file in it is one of the above) and refuses any
other; and even in its own folder it counts, trims and removes only files whose names and places are
exactly the above, so that nothing it did not write is ever deleted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections.abc import Iterator

from batchvl.errors import UserError

logger = logging.getLogger(__name__)

MARKER = "BATCHVL_ENCODER_CACHE"
LAYOUT = 1  # the marker's version: a new layout is a new number, and another number is not this cache's
MARKER_TEXT = f"batchvl encoder cache, layout {LAYOUT}\n"
DIGESTS = "digests"
SUFFIX = ".emb"

_HEX32 = "[0-9a-f]{32}"
_TEMPORARY = rf"\.[0-9]+\.{_HEX32}\.tmp"
_SUBFOLDER = re.compile("[0-9a-f]{2}")
_DIGEST = re.compile(_HEX32)
_DIGEST_TEMPORARY = re.compile(_HEX32 + _TEMPORARY)
_MARKER_TEMPORARY = re.compile(re.escape(MARKER) + _TEMPORARY)


def entry_path(folder: str, key: str) -> str:
    return os.path.join(folder, key[:2], key + SUFFIX)


def temporary_path(path: str) -> str:
    """The name `path` is written under before it is renamed into place: one no other writer uses."""
    return f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


def write_file(path: str, data: bytes) -> None:
    """Write `path` whole or not at all: under `temporary_path`, renamed into place (a reader opens no
    file or a whole one). An OSError is raised with the temporary file removed."""
    temporary = temporary_path(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def refusal(folder: str) -> str | None:
    """Why the cache may not use `folder` (one line, with the fix), or None where it may: the folder is
    not there yet, or is marked as this cache's, or holds no file but the cache's own."""
    marker = _read_marker(folder)
    if marker == MARKER_TEXT:
        return None
    fix = "point it at an empty or new folder, or at the folder of an earlier encoder cache"
    if marker is not None:
        return (
            f"engine.encoder_cache_dir: {folder} holds a {MARKER} file of another layout "
            f"({marker[:60]!r}, this version writes layout {LAYOUT}); {fix}"
        )
    foreign = _first_foreign_file(folder)
    if foreign is not None:
        return (
            f"engine.encoder_cache_dir: {folder} holds files the encoder cache did not write "
            f"({os.path.relpath(foreign, folder)}) and no {MARKER} marker; {fix}"
        )
    return None


def adopt(folder: str) -> None:
    """Make `folder` this cache's (made if missing, its marker written), or raise UserError where it
    holds files the cache did not write."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise UserError(
            f"engine.encoder_cache_dir {folder} cannot be made ({error.strerror or error}); "
            "give a local folder this job can write to"
        ) from None
    why = refusal(folder)
    if why is not None:
        raise UserError(why)
    if _read_marker(folder) is None:
        _write_marker(folder)


def entries(folder: str) -> Iterator[tuple[str, os.stat_result]]:
    """The cache's entry files, with their stats."""
    for subfolder in _subfolders(folder):
        yield from _files_named(subfolder, re.compile(_entry_name(subfolder)))


def temporaries(folder: str) -> Iterator[tuple[str, os.stat_result]]:
    """The files the cache was writing (or a killed writer left), with their stats."""
    for subfolder in _subfolders(folder):
        yield from _files_named(subfolder, re.compile(_entry_name(subfolder) + _TEMPORARY))
    yield from _files_named(os.path.join(folder, DIGESTS), _DIGEST_TEMPORARY)
    yield from _files_named(folder, _MARKER_TEMPORARY)


def _entry_name(subfolder: str) -> str:
    """The pattern of an entry's name in `subfolder`: its key starts with the subfolder's name."""
    return re.escape(os.path.basename(subfolder)) + "[0-9a-f]{30}" + re.escape(SUFFIX)


def _is_own(folder: str, directory: str, name: str) -> bool:
    """Whether the file `name` in `directory` (somewhere under `folder`) is one the cache writes."""
    place = os.path.relpath(directory, folder)
    if place == ".":
        return name == MARKER or _MARKER_TEMPORARY.fullmatch(name) is not None
    if place == DIGESTS:
        return _DIGEST.fullmatch(name) is not None or _DIGEST_TEMPORARY.fullmatch(name) is not None
    if _SUBFOLDER.fullmatch(place):
        return re.fullmatch(f"{_entry_name(place)}({_TEMPORARY})?", name) is not None
    return False


def _first_foreign_file(folder: str) -> str | None:
    """A file (or link) under `folder` that the cache does not write, or None. Folders holding no files
    are not counted: planning's own check of the folder makes and removes an empty one."""
    for directory, subfolders, names in os.walk(folder):
        for name in subfolders:
            if os.path.islink(os.path.join(directory, name)):  # the walk does not follow it: not ours
                return os.path.join(directory, name)
        for name in names:
            path = os.path.join(directory, name)
            if os.path.islink(path) or not _is_own(folder, directory, name):
                return path
    return None


def _subfolders(folder: str) -> list[str]:
    """The entries' subfolders (real folders named by two hexadecimal digits, not links)."""
    with contextlib.suppress(OSError), os.scandir(folder) as listing:
        return [
            item.path
            for item in listing
            if _SUBFOLDER.fullmatch(item.name) and item.is_dir(follow_symlinks=False)
        ]
    return []


def _files_named(directory: str, pattern: re.Pattern) -> Iterator[tuple[str, os.stat_result]]:
    """The plain files in `directory` whose names are exactly `pattern` (a directory that cannot be
    listed, or a file removed while listed, is left out)."""
    try:
        with os.scandir(directory) as listing:
            items = [item for item in listing if pattern.fullmatch(item.name)]
    except OSError:
        return
    for item in items:
        with contextlib.suppress(OSError):
            if item.is_file(follow_symlinks=False):
                yield item.path, item.stat(follow_symlinks=False)


def _read_marker(folder: str) -> str | None:
    """The marker's text, or None where there is none."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8", errors="replace") as file:
            return file.read(200)
    except FileNotFoundError:
        return None
    except OSError as error:  # a folder of that name, or a file that cannot be read: not this cache's
        return f"unreadable: {error.strerror or error}"


def _write_marker(folder: str) -> None:
    # Whole or not at all: a process starting beside this one reads the whole marker or none (and then
    # this folder holds only the cache's files, which it adopts as well).
    try:
        write_file(os.path.join(folder, MARKER), MARKER_TEXT.encode())
    except OSError as error:  # the cache never fails a job: its writes fail likewise and are logged
        logger.warning("encoder disk cache: cannot mark %s as its folder (%s)", folder, error)
