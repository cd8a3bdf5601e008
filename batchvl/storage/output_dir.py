"""The job's output folder, `output.dir`: a local folder, or a prefix on an object store (`s3://bucket/
prefix`, `gs://...`, any fsspec filesystem). Every file batchvl writes there goes through an `OutputDir`.

Files are named by their location: a local path, or a URL under the folder's URL (`join` makes them).
Both kinds give the two guarantees the commit protocol (`commit.py`) and the claims (`claims.py`) need:
- a file written by `write_bytes` is seen whole or not at all, never half written: a local file is
  written to a hidden temp name, synced and renamed into place; an object store shows an object only
  once its upload is complete (there is no rename on object stores, and none is needed for this);
- `create_exclusive` creates a file only if none is there, atomically: a hard link to a written temp file
  locally; a conditional PUT (`If-None-Match: *`) on S3. A filesystem that refuses conditional writes
  gets check-then-write, which two runs can pass at once (they then both run the shard and commit the
  same rows: work is repeated, rows are not).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import posixpath
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from batchvl.config import OutputConfig, is_remote
from batchvl.errors import OutputWriteFailed, UserError
from batchvl.storage import layout
from batchvl.storage.reads_at_once import READS_AT_ONCE

TEMP_INFIX = ".tmp-"  # local temp files: .<name>.tmp-<host>-<pid>, hidden, never matching *.parquet
# The temp files of local writes: a whole file's (`write_bytes`: its writer's host and pid), and a claim's
# (`create_exclusive`, `remove_if_holds`: a random name, and a suffix while a claim is checked)
OWNED_TEMP = re.compile(rf"\..+{re.escape(TEMP_INFIX)}(?P<host>.+)-(?P<pid>[0-9]+)")
UNNAMED_TEMP = re.compile(rf".+{re.escape(TEMP_INFIX)}[0-9a-f]{{32}}(-probe|-taken)?")
# A temp file lives as long as one write (or one check of a claim); one this old is a killed writer's,
# whichever host wrote it
TEMP_MAX_AGE_S = 3600.0


class OutputDir:
    """Where a job's results and bookkeeping live; `url` is a local path or an fsspec URL."""

    reads_at_once = 1  # how many shards a plan reads at a time here (`reads_at_once.py`)

    def __init__(self, url: str):
        self.url = url

    @staticmethod
    def of(output: OutputConfig) -> OutputDir:
        return open_output_dir(output.dir, output.storage_options)

    def join(self, *parts: str) -> str:
        return posixpath.join(self.url, *parts)

    def write_text(self, location: str, text: str) -> None:
        self.write_bytes(location, text.encode())

    def read_text(self, location: str) -> str:
        return self.read_bytes(location).decode()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # What each kind implements:
    def write_bytes(self, location: str, data: bytes) -> None:
        """Write the file whole (see the module's note); replaces an existing one."""
        raise NotImplementedError

    def read_bytes(self, location: str) -> bytes:
        """The file's bytes; FileNotFoundError when there is none."""
        raise NotImplementedError

    def open(self, location: str) -> BinaryIO:
        """The file, opened for reading (a remote one fetches byte ranges as they are read)."""
        raise NotImplementedError

    def size(self, location: str) -> int | None:
        """The file's size in bytes; None when there is no such file."""
        raise NotImplementedError

    def modified(self, location: str) -> float | None:
        """When the file was last written (seconds since the epoch); None when there is no such file."""
        raise NotImplementedError

    def remove(self, location: str) -> None:
        """Remove the file if it is there."""
        raise NotImplementedError

    def list(self, folder: str, pattern: str) -> list[str]:
        """The files directly in `folder` whose names match the glob `pattern`, oldest first."""
        raise NotImplementedError

    def find(self, folder: str, pattern: str) -> list[str]:
        """The files at any depth under `folder` whose names match the glob `pattern`."""
        raise NotImplementedError

    def create_exclusive(self, location: str, text: str) -> bool:
        """Create the file holding `text` unless one is there; False when there is one."""
        raise NotImplementedError

    def remove_if_holds(self, location: str, data: bytes) -> None:
        """Remove the file if it holds `data` (a claim judged stale, or our own). Locally, a file that
        replaced it since is never removed; on an object store, reading and removing are two requests, and
        a file put there between them is removed."""
        raise NotImplementedError

    def touch_if_holds(self, location: str, data: bytes) -> None:
        """Make the file's modified time now if it holds `data` (our claim's heartbeat). Locally, only the
        file read is touched; on an object store, the file is read, then written again, and one put there
        between them is replaced by `data`."""
        raise NotImplementedError

    def check_writable(self, create: bool) -> None:
        """A user error unless this process can write here; `create` makes the folder (a run), else
        nothing is written where that can be avoided (a preflight)."""
        raise NotImplementedError

    def exists(self) -> bool:
        """Whether the folder is there (a remote prefix: whether any file is under it)."""
        raise NotImplementedError


def open_output_dir(url: str, storage_options: dict | None = None) -> OutputDir:
    return RemoteDir(url, storage_options or {}) if is_remote(url) else LocalDir(url)


def write_file(path: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write one whole file at a local path (relative to the current folder) or an object-store URL (with
    `storage_options`); a place that cannot be written is a one-line `UserError`."""
    target = path if is_remote(path) else os.path.abspath(path)
    try:
        open_output_dir(posixpath.dirname(target), storage_options).write_bytes(target, data)
    except OSError as exc:  # a missing bucket or folder, no permission
        raise UserError(f"cannot write {path} ({exc}); check the path and its permissions") from None


@contextlib.contextmanager
def _naming(location: str) -> Iterator[None]:
    """An OS error while writing the file `location` (through its temp file) as `OutputWriteFailed`
    naming it: the error of a failed write() names no file, and the temp file's name means nothing."""
    try:
        yield
    except OSError as exc:
        raise OutputWriteFailed(exc.errno, exc.strerror or str(exc), location) from exc


class LocalDir(OutputDir):
    def write_bytes(self, location: str, data: bytes) -> None:
        folder = os.path.dirname(location)
        os.makedirs(folder, exist_ok=True)
        name = f".{os.path.basename(location)}{TEMP_INFIX}{socket.gethostname()}-{os.getpid()}"
        temp = os.path.join(folder, name)
        try:
            with _naming(location):
                with open(temp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, location)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)

    def read_bytes(self, location: str) -> bytes:
        return Path(location).read_bytes()

    def open(self, location: str) -> BinaryIO:
        return open(location, "rb")  # noqa: SIM115 (the caller closes it)

    def size(self, location: str) -> int | None:
        try:
            return os.stat(location).st_size if os.path.isfile(location) else None
        except OSError:
            return None

    def modified(self, location: str) -> float | None:
        try:
            return os.path.getmtime(location)
        except OSError:
            return None

    def remove(self, location: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(location)

    def list(self, folder: str, pattern: str) -> list[str]:
        paths = [p for p in Path(folder).glob(pattern) if p.is_file()] if os.path.isdir(folder) else []
        return [str(p) for p in sorted(paths, key=lambda p: (p.stat().st_mtime, p.name))]

    def find(self, folder: str, pattern: str) -> list[str]:
        return [str(p) for p in Path(folder).rglob(pattern) if p.is_file()]

    def create_exclusive(self, location: str, text: str) -> bool:
        # written to a temp name, then hard-linked, which fails if `location` exists: never half written
        os.makedirs(os.path.dirname(location), exist_ok=True)
        temp = f"{location}{TEMP_INFIX}{uuid.uuid4().hex}"
        with _naming(location), open(temp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, location)
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(temp)

    def remove_if_holds(self, location: str, data: bytes) -> None:
        # A second name pins the file that is checked; the file is then renamed away, and put back, never
        # over another, if the rename took a file that replaced it in the meantime (another taker's).
        unique = f"{location}{TEMP_INFIX}{uuid.uuid4().hex}"
        probe, taken = f"{unique}-probe", f"{unique}-taken"
        try:
            os.link(location, probe)
        except FileNotFoundError:
            return
        try:
            if self.read_bytes(probe) != data:
                return
            try:
                os.rename(location, taken)
            except FileNotFoundError:
                return  # removed by another taker
            if not os.path.samefile(taken, probe):
                with contextlib.suppress(FileExistsError):  # a file made since stays: never replaced
                    os.link(taken, location)
            os.remove(taken)
        finally:
            os.remove(probe)

    def touch_if_holds(self, location: str, data: bytes) -> None:
        with contextlib.suppress(FileNotFoundError), open(location, "rb") as handle:
            if handle.read() == data:
                os.utime(handle.fileno())  # the file read, even if another has replaced it since

    def check_writable(self, create: bool) -> None:
        existing = self.url
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise UserError(
                f"output.dir {self.url}: {existing} is not a folder; set output.dir to a folder path"
            )
        try:
            if create:
                os.makedirs(self.url, exist_ok=True)
            handle, probe = tempfile.mkstemp(
                prefix=".batchvl-write-check-", dir=self.url if create else existing
            )
            os.close(handle)
            os.remove(probe)
        except OSError as exc:
            raise UserError(
                f"output.dir {self.url} cannot be written ({exc.strerror or exc}); set output.dir to a "
                "folder you can write to"
            ) from None

    def exists(self) -> bool:
        return os.path.isdir(self.url)

    def remove_stale_temps(self, location: str) -> None:
        """Remove temp files of `location` left by killed runs on this host (their pid is gone)."""
        folder, name = os.path.split(location)
        if not os.path.isdir(folder):
            return
        for entry in os.listdir(folder):
            owned = OWNED_TEMP.fullmatch(entry)
            if entry.startswith(f".{name}{TEMP_INFIX}") and _writer_is_gone(owned):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, entry))

    def remove_dead_temps(self, folder: str) -> None:
        """Remove the temp files at any depth under `folder` that killed writers left: those of this host
        whose process is gone, and any older than `TEMP_MAX_AGE_S` (another host's process cannot be
        asked, and a claim's temp names none). A live writer's temp file, younger, is kept."""
        for root, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(root, name)
                if _is_dead_temp(name, self.modified(path)):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)


def _is_dead_temp(name: str, modified: float | None) -> bool:
    owned = OWNED_TEMP.fullmatch(name)
    if owned is None and UNNAMED_TEMP.fullmatch(name) is None:
        return False  # not a temp file
    if _writer_is_gone(owned):
        return True
    return modified is not None and time.time() - modified > TEMP_MAX_AGE_S


def _writer_is_gone(owned: re.Match | None) -> bool:
    """Whether the temp file's writer (its `OWNED_TEMP` match) was a process of this host that is gone."""
    return owned is not None and owned["host"] == socket.gethostname() and not _pid_alive(int(owned["pid"]))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RemoteDir(OutputDir):
    """A prefix on an fsspec filesystem. Listings are never cached: other tasks write here too."""

    reads_at_once = READS_AT_ONCE  # each read waits on the network

    def __init__(self, url: str, storage_options: dict):
        super().__init__(url.rstrip("/"))
        self.storage_options = storage_options
        self._fs, self.root = self._connect()
        self._pid = os.getpid()

    def _connect(self):
        import fsspec

        try:
            return fsspec.core.url_to_fs(self.url, **self.storage_options, use_listings_cache=False)
        except (ImportError, ValueError) as exc:
            raise UserError(f"output.dir: cannot write to '{self.url}': {exc}") from None

    @property
    def fs(self):
        """The filesystem, made again in a forked process (preprocessing workers claim shards): an async
        filesystem's event loop does not survive a fork."""
        if self._pid != os.getpid():
            self._fs, _ = self._connect()
            self._pid = os.getpid()
        return self._fs

    def _path(self, location: str) -> str:
        return self.root + location[len(self.url) :]

    def write_bytes(self, location: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(location), data)

    def read_bytes(self, location: str) -> bytes:
        return self.fs.cat_file(self._path(location))

    def open(self, location: str) -> BinaryIO:
        return self.fs.open(self._path(location), "rb")

    def size(self, location: str) -> int | None:
        try:
            info = self.fs.info(self._path(location))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def modified(self, location: str) -> float | None:
        try:
            return self.fs.modified(self._path(location)).timestamp()
        except FileNotFoundError:
            return None

    def remove(self, location: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(location))

    def list(self, folder: str, pattern: str) -> list[str]:
        try:
            entries = self.fs.ls(self._path(folder), detail=True)
        except FileNotFoundError:
            return []
        files = [
            (_modified_of(entry), posixpath.basename(entry["name"]))
            for entry in entries
            if entry.get("type") == "file" and fnmatch.fnmatchcase(posixpath.basename(entry["name"]), pattern)
        ]
        return [posixpath.join(folder, name) for _, name in sorted(files)]

    def find(self, folder: str, pattern: str) -> list[str]:
        try:
            paths = self.fs.find(self._path(folder))
        except FileNotFoundError:
            return []
        root = self._path(folder).rstrip("/")
        found = [p for p in paths if fnmatch.fnmatchcase(posixpath.basename(p), pattern)]
        return [folder + p[len(root) :] for p in found]

    def create_exclusive(self, location: str, text: str) -> bool:
        path = self._path(location)
        try:
            self.fs.pipe_file(path, text.encode(), mode="create")
            return True
        except FileExistsError:
            return False
        except (NotImplementedError, TypeError, ValueError):  # no conditional writes: check, then write
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, text.encode())
            return True

    def remove_if_holds(self, location: str, data: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.read_bytes(location) == data:
                self.remove(location)

    def touch_if_holds(self, location: str, data: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.read_bytes(location) == data:  # an object's time is only changed by writing it
                self.fs.pipe_file(self._path(location), data)

    def check_writable(self, create: bool) -> None:
        try:
            if create:  # only a write tells whether writes are allowed
                probe = self.join(layout.OWN_FILES, f".write-check-{uuid.uuid4().hex}")
                self.write_bytes(probe, b"")
                self.remove(probe)
            else:
                self.fs.ls(self.root.split("/")[0])  # the bucket (or root) can be listed
        except Exception as exc:  # noqa: BLE001 (each filesystem has its own: botocore's NoCredentialsError...)
            raise UserError(
                f"output.dir {self.url} cannot be written ({exc}); check the bucket and "
                "output.storage_options (credentials, endpoint_url)"
            ) from None

    def exists(self) -> bool:
        return bool(self.fs.exists(self.root))


def _modified_of(entry: dict) -> float:
    """An entry's modified time, under the name its filesystem gives it (0 when it gives none)."""
    value = entry.get("LastModified", entry.get("mtime", entry.get("created", 0)))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0)
