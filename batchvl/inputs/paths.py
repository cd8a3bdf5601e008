"""Path confinement: media paths from data resolve under a root, never outside it."""

from __future__ import annotations

import fnmatch
import glob
import os
import stat

from batchvl.errors import SampleError, UserError
from batchvl.inputs.stamps import input_stamp
from batchvl.inputs.types import ShardInfo
from batchvl.storage.remote import glob_remote, is_remote


def resolve_under_root(path: str, root: str) -> str:
    """Resolve a media path, relative to `root` or absolute (symlinks followed), that must lead inside
    `root`; the refusal of one that does not names the rule it broke."""
    resolved = os.path.realpath(os.path.join(root, path))  # an absolute `path` is joined as itself
    if os.path.commonpath([resolved, root]) != root:
        raise SampleError("path_outside_root", f"media path '{path}' {_outside(path, root, resolved)}")
    if not os.path.exists(resolved):
        raise SampleError("file_not_found", f"media file not found: {resolved}")
    if not os.path.isfile(resolved):
        raise SampleError("not_a_file", f"media path is {_kind_of(resolved)}, not a file: {resolved}")
    return resolved


def _outside(path: str, root: str, resolved: str) -> str:
    """Which way `path` leads outside `root`, for its refusal."""
    written = os.path.normpath(os.path.join(root, path))
    if os.path.commonpath([written, root]) == root:
        return f"is a symbolic link (or lies under one) to {resolved}, outside input.root '{root}'"
    if os.path.isabs(path):
        return f"is absolute and not under input.root '{root}'"
    return f"climbs out of input.root '{root}' with '..'"


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


def has_glob(part: str) -> bool:
    return any(char in part for char in "*?[")


def glob_base(pattern: str) -> str:
    """The folder a glob's matches are named relative to: its part before the first wildcard (for a plain
    path, its folder). It depends on the pattern alone, so adding another input pattern to a job never
    renames the shards this one matches."""
    parts = pattern.split(os.sep)
    for index, part in enumerate(parts):
        if has_glob(part):
            return os.sep.join(parts[:index]) or os.sep
    return os.path.dirname(pattern)


def glob_matches(pattern: str, path: str) -> bool:
    """Whether `path` would be matched by `pattern` (absolute, '/'-separated, `**` for any depth)."""

    def match(pattern_parts: list[str], path_parts: list[str]) -> bool:
        if not pattern_parts:
            return not path_parts
        head, rest = pattern_parts[0], pattern_parts[1:]
        if head == "**":
            return any(match(rest, path_parts[skip:]) for skip in range(len(path_parts) + 1))
        return bool(path_parts) and fnmatch.fnmatchcase(path_parts[0], head) and match(rest, path_parts[1:])

    return match(pattern.strip(os.sep).split(os.sep), path.strip(os.sep).split(os.sep))


def match_files(
    patterns: list[str], suffixes: tuple[str, ...], what: str, storage_options: dict | None = None
) -> list[tuple[str, str]]:
    """(absolute path or URL, shard id) of the files matching any glob that end with one of `suffixes`,
    sorted by id. The id is the path relative to its pattern's `glob_base`; a file that several patterns
    match is named by the first of them. A pattern with a protocol (`s3://...`) is listed through fsspec."""
    found: dict[str, str] = {}
    for pattern in patterns:
        if is_remote(pattern):
            urls, path = glob_remote(pattern, storage_options or {})
            matched = [url for url in urls if url.lower().endswith(suffixes)]
            if not matched:
                raise UserError(f"input.paths: no {what} match '{pattern}'; check the path or glob")
            base = glob_base(path)
            for url in matched:
                found.setdefault(url, relative_id(url.split("://", 1)[1], base))
            continue
        every = glob.glob(pattern, recursive=True)
        named = [p for p in every if p.lower().endswith(suffixes)]
        matched = [p for p in named if os.path.isfile(p)]
        for folder in (p for p in named if os.path.isdir(p)):
            inside = os.path.join(folder, "")
            if not any(path.startswith(inside) for path in matched):  # its files would go unread, unsaid
                raise UserError(
                    f"input.paths: '{folder}' matches '{pattern}' but is a folder (a dataset written as a "
                    f"folder of part files?); name its files, e.g. '{inside}*{suffixes[0]}'"
                )
        if not matched:
            others = sorted(p for p in every if os.path.isfile(p))  # looked at only when it is needed
            if others:  # `format: webdataset` left over a glob of Parquet files
                raise UserError(
                    f"input.paths: no {what} match '{pattern}', but {len(others)} other file(s) do, such as "
                    f"'{others[0]}'; set input.format to the reader of those files (docs/inputs.md)"
                )
            raise UserError(f"input.paths: no {what} match '{pattern}'; check the path or glob")
        base = glob_base(pattern)
        for path in matched:
            found.setdefault(os.path.abspath(path), relative_id(path, base))
    return sorted(found.items(), key=lambda item: item[1])


def stream_shards(
    patterns: list[str], suffixes: tuple[str, ...], what: str, storage_options: dict
) -> list[ShardInfo]:
    """The shards of a format whose files are shards with no sample count known before reading them."""
    return [
        ShardInfo(sid, path, None, stamp=input_stamp(path, storage_options))
        for path, sid in match_files(patterns, suffixes, what, storage_options)
    ]


def relative_id(path: str, base: str) -> str:
    return text_name(os.path.relpath(path, base).replace(os.sep, "/"))


def text_name(name: str) -> str:
    """A file or tar member name as text that can be written anywhere: bytes of the name that are not
    UTF-8 (a Latin-1 'café' on Linux), which os and tarfile keep as lone surrogates that neither a Parquet
    column nor UTF-8 takes, become `\\xNN` escapes (another lone surrogate, `\\udNNN`). A UTF-8 name is
    returned as it is."""
    try:
        return name.encode(errors="surrogateescape").decode(errors="backslashreplace")
    except UnicodeEncodeError:  # a surrogate no undecodable byte gives
        return name.encode(errors="backslashreplace").decode()
