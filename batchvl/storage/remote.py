"""Input files on object stores and other filesystems, through fsspec (`s3://`, `gs://`, `memory://`, ...).

A path with a protocol is read through the fsspec filesystem of that protocol (s3fs for `s3://`, gcsfs for
`gs://`: installed by the user), with `input.storage_options` (credentials, endpoint) or, as fsspec users
expect, the environment's (AWS_* variables, ~/.aws, gcloud's). Files are opened as seekable streams that
fetch byte ranges on demand, so a shard is never downloaded whole before it is read.
"""

from __future__ import annotations

import difflib
import inspect
import re

from batchvl.config import is_remote
from batchvl.errors import UserError

# Protocols whose client set-up reads no network and refuses an unknown option; others are only built.
CLIENT_SET_UP_OFFLINE = ("s3", "s3a")


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


def check_storage_options(key: str, storage_options: dict, urls: list[str]) -> None:
    """The filesystem of each URL's protocol takes the options: a user error naming `key` otherwise. s3fs
    accepts any option when built and refuses an unknown one (`endpoint` for `endpoint_url`) only when it
    first connects, which would be in the middle of a run; its client is set up here, without a request."""
    import fsspec

    for protocol in sorted({url.split("://", 1)[0] for url in urls if is_remote(url)}):
        try:
            fs = fsspec.filesystem(protocol, skip_instance_cache=True, **storage_options)
            if protocol in CLIENT_SET_UP_OFFLINE:
                fs.connect()
        except ImportError:
            continue  # reading the URL says which package to install
        except (TypeError, ValueError) as exc:
            raise UserError(options_mismatch(key, protocol, exc)) from None


def options_mismatch(key: str, protocol: str, exc: Exception) -> str:
    """Why a filesystem refused its storage options, with the option meant where one is close."""
    return f"{key} do not suit {protocol}:// ({exc}){_did_you_mean(protocol, exc)}"


def _did_you_mean(protocol: str, exc: Exception) -> str:
    import fsspec

    unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
    if unknown is None:
        return ""
    accepted = list(inspect.signature(fsspec.get_filesystem_class(protocol).__init__).parameters)
    close = difflib.get_close_matches(unknown.group(1), accepted, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""
