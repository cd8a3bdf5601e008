"""The encoder disk cache (`engine.encoder_cache_dir`): image embeddings kept in a local folder, read by
later runs and by other jobs over the same images, bounded by `engine.encoder_cache_dir_gb`.

An entry is one file, `<folder>/<key[:2]>/<key>.emb`, where the key digests the image's content hash and
the model's vision digest (`vision_digest.py`), and the file is the checked format of
`disk_entry.py`. The folder is marked as the cache's, and the cache counts and deletes nothing but its
own files (`disk_layout.py`). Several processes (concurrent runs, the tasks of a Slurm array on one node)
share the folder without locks:

- A writer writes a temporary file beside the entry and renames it into place, so a reader opens either
  no file or a whole one; two writers of one key write the same embedding, and the last rename wins.
  Nothing is fsynced: a file that a crash left short or zeroed fails its checksum and is encoded again.
- An entry that cannot be read whole (corrupt, truncated, of another key or format) is a miss: the image
  is encoded and the entry written again. The cache never fails a job: a folder that cannot be written
  is logged once and the job goes on without storing; a folder where one entry goes is logged and that
  entry skipped; an embedding over what a trim leaves of the bound is not stored (logged once).
- Recency is the file's modification time, set when it is written and touched on every hit. A process
  that sees the folder over its bound deletes the least recently used entries down to 90% of it (and
  temporary files an hour old, left by a killed writer). Each process counts the folder's size at its
  start and adds what it writes, so processes writing at once may hold the folder over its bound by
  what the others wrote since their last count, until one of them counts again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
import xxhash

from batchvl.engine.encoder_cache import disk_layout
from batchvl.engine.encoder_cache.disk_entry import decode_entry, encode_entry
from batchvl.utils.memory import GB, MB

logger = logging.getLogger(__name__)


TRIM_TO = 0.9  # share of the bound left after trimming, so that a full folder is not counted every write
STALE_TEMPORARY_S = 3600.0  # a temporary file this old belongs to a writer that is gone


class EncoderDiskCache:
    def __init__(self, folder: str, capacity_bytes: int, model_digest: str):
        self.folder = folder
        self.capacity_bytes = capacity_bytes
        self.model_digest = model_digest
        self.hits = 0
        self.writes = 0
        self.seconds = 0.0  # reading and writing entries
        self._can_write = True
        self._warned_too_large = False
        disk_layout.adopt(folder)  # refuses a folder holding files the cache did not write
        self._size = self._trim()  # the folder's size as this process counts it

    def key(self, content_hash: str) -> str:
        return xxhash.xxh3_128_hexdigest(f"{self.model_digest}:{content_hash}".encode())

    def path(self, content_hash: str) -> str:
        return disk_layout.entry_path(self.folder, self.key(content_hash))

    def load(self, content_hash: str) -> torch.Tensor | None:
        """The cached embedding of an image (on the CPU), or None when there is no whole entry of it."""
        started = time.perf_counter()
        path = self.path(content_hash)
        data = _read(path)
        embedding = decode_entry(self.key(content_hash), data) if data is not None else None
        self.seconds += time.perf_counter() - started
        if embedding is None:
            if data is not None:
                logger.warning("encoder disk cache: %s is damaged; the image is encoded again", path)
            return None
        with contextlib.suppress(OSError):  # evicted meanwhile: the embedding read is still whole
            os.utime(path)  # most recently used
        self.hits += 1
        return embedding

    def store(self, content_hash: str, embedding: torch.Tensor) -> None:
        """Write an image's embedding (atomically: a temporary file renamed into place)."""
        if not self._can_write:
            return
        started = time.perf_counter()
        path = self.path(content_hash)
        data = encode_entry(self.key(content_hash), embedding)
        if not self._fits(len(data)):
            return
        try:
            disk_layout.write_file(path, data)
        except IsADirectoryError:  # a folder where this one entry goes: the others can still be written
            logger.warning("encoder disk cache: %s is a folder, not an entry; not storing that image", path)
            return
        except OSError as error:
            logger.warning(
                "encoder disk cache: cannot write to %s (%s); not storing more", self.folder, error
            )
            self._can_write = False
            return
        finally:
            self.seconds += time.perf_counter() - started
        self.writes += 1
        self._size += len(data)
        if self._size > self.capacity_bytes:
            self._size = self._trim()

    def _fits(self, entry_bytes: int) -> bool:
        """Whether an entry this large can stay in the folder: one over what a trim leaves would be
        deleted by the trim its own write starts (and every other entry with it)."""
        if entry_bytes <= self.capacity_bytes * TRIM_TO:
            return True
        if not self._warned_too_large:  # once: every later embedding is about as large
            logger.warning(
                "encoder disk cache: an embedding of %.1f MiB is over %d%% of engine.encoder_cache_dir_gb "
                "(%.3g GiB), so it is not stored; raise engine.encoder_cache_dir_gb to keep embeddings",
                entry_bytes / MB,
                round(TRIM_TO * 100),
                self.capacity_bytes / GB,
            )
            self._warned_too_large = True
        return False

    def _trim(self) -> int:
        """Count the entries, delete the least recently used while they are over the bound, and return the
        size left. Only the cache's own files are counted or deleted (`disk_layout.py`)."""
        now = time.time()
        for path, stat in disk_layout.temporaries(self.folder):
            if now - stat.st_mtime > STALE_TEMPORARY_S:
                _remove(path)
        entries = sorted(
            (stat.st_mtime_ns, stat.st_size, path) for path, stat in disk_layout.entries(self.folder)
        )
        size = sum(entry_size for _, entry_size, _ in entries)
        if size <= self.capacity_bytes:
            return size
        for _, entry_size, path in entries:
            if size <= self.capacity_bytes * TRIM_TO:
                break
            _remove(path)
            size -= entry_size
        return size


def _read(path: str) -> bytearray | None:
    """A file's bytes, or None when it is not there (never written, or evicted by another process)."""
    try:
        with open(path, "rb") as file:
            data = bytearray(os.fstat(file.fileno()).st_size)
            del data[file.readinto(data) :]  # a file cut short since its size was read
            return data
    except OSError:
        return None


def _remove(path: str) -> None:
    # another process removed it first, or the folder is not ours to change (the entry stays, still checked)
    with contextlib.suppress(OSError):
        os.remove(path)
