"""Input files on object stores and other filesystems, through fsspec (`s3://`, `gs://`, `memory://`, ...).

A path with a protocol is read through the fsspec filesystem of that protocol (s3fs for `s3://`, gcsfs for
`gs://`: installed by the user), with `input.storage_options` (credentials, endpoint) or, as fsspec users
expect, the environment's (AWS_* variables, ~/.aws, gcloud's). Files are opened as seekable streams that
fetch byte ranges on demand, so a shard is never downloaded whole before it is read.
"""

from __future__ import annotations

from batchvl.config import is_remote
from batchvl.errors import UserError


def filesystem(url: str, storage_options: dict):
    """(fsspec filesystem, the path within it) of a URL; a user error when its protocol cannot be used."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except (ImportError, ValueError) as exc:
        raise UserError(f"input.paths: cannot read '{url}': {exc}") from None
    return fs, path


def glob_remote(pattern: str, storage_options: dict) -> tuple[list[str], str]:
    """(URLs of the files matching the pattern, the pattern's path within its filesystem)."""
    fs, path = filesystem(pattern, storage_options)
    try:
        found = fs.glob(path) if any(char in path for char in "*?[") else [path] if fs.isfile(path) else []
        matched = [p for p in found if fs.isfile(p)]
    except (OSError, PermissionError) as exc:
        raise UserError(f"input.paths: cannot list '{pattern}': {exc}") from None
    return [fs.unstrip_protocol(p) for p in matched], path


def open_remote(url: str, storage_options: dict, mode: str = "rb"):
    fs, path = filesystem(url, storage_options)
    return fs.open(path, mode)


def open_input(path: str, storage_options: dict):
    """A local path or a URL, opened for binary reading."""
    return open_remote(path, storage_options) if is_remote(path) else open(path, "rb")  # noqa: SIM115
