"""Path confinement: media paths from data resolve under a root, never outside it."""

from __future__ import annotations

import glob
import os
import stat

from batchvl.errors import SampleError, UserError


def resolve_under_root(path: str, root: str) -> str:
    """Resolve a relative path under `root` (symlinks followed); refuse absolute paths and escapes."""
    resolved = os.path.realpath(os.path.join(root, path))
    if os.path.isabs(path) or os.path.commonpath([resolved, root]) != root:
        raise SampleError("path_outside_root", f"media path '{path}' resolves outside input.root '{root}'")
    if not os.path.exists(resolved):
        raise SampleError("file_not_found", f"media file not found: {resolved}")
    if not os.path.isfile(resolved):
        raise SampleError("not_a_file", f"media path is {_kind_of(resolved)}, not a file: {resolved}")
    return resolved


def _kind_of(path: str) -> str:
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def is_empty_file(path: str) -> bool:
    try:
        return os.path.getsize(path) == 0
    except OSError:
        return False  # a missing file is reported where it is opened


def match_files(patterns: list[str], suffixes: tuple[str, ...], what: str) -> list[str]:
    """Sorted absolute paths of files matching any glob that end with one of `suffixes`."""
    files: set[str] = set()
    for pattern in patterns:
        matched = [
            p
            for p in glob.glob(pattern, recursive=True)
            if p.lower().endswith(suffixes) and os.path.isfile(p)
        ]
        if not matched:
            raise UserError(f"input.paths: no {what} match '{pattern}'; check the path or glob")
        files.update(os.path.abspath(p) for p in matched)
    return sorted(files)


def relative_ids(paths: list[str]) -> list[str]:
    """Shard ids: each path relative to the common folder of all of them, with '/' separators."""
    common = os.path.commonpath([os.path.dirname(p) for p in paths])
    return [os.path.relpath(p, common).replace(os.sep, "/") for p in paths]
