"""The local folders that caches make on first use (`input.download.cache_dir`, `engine.encoder_cache_dir`),
checked when the job is planned: a cache that could never be written is a one-line mistake before the model
loads or a sample is read, not a failure after minutes of loading (or a cache silently left unused). The
encoder cache deletes files in its folder, so its folder is also one that holds nothing else: not the
results (`output.dir`), and no file the cache did not write (`disk_layout.py`)."""

from __future__ import annotations

import os
import tempfile

from batchvl.config import is_remote
from batchvl.engine.encoder_cache import disk_layout
from batchvl.errors import UserError


def check_cache_folder(setting: str, folder: str | None) -> None:
    """`folder` is a folder, or can be made one, that this process can write."""
    if folder is None:
        return
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):  # the folder is made on first use: its nearest existing parent
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{setting}: {existing} is a file, not a folder; point it at a folder")
    if not _can_make_folder_in(existing):
        raise UserError(f"{setting}: {existing} cannot be written; point it at a folder you own")


def check_encoder_cache_folder(folder: str | None, output_dir: str) -> None:
    """`engine.encoder_cache_dir` can be written, lies neither inside `output.dir` nor around it, and is
    new, empty, or the encoder cache's own."""
    check_cache_folder("engine.encoder_cache_dir", folder)
    if folder is None:
        return
    if not is_remote(output_dir):
        cache, results = os.path.realpath(folder), os.path.realpath(output_dir)
        if os.path.commonpath([cache, results]) in (cache, results):
            raise UserError(
                f"engine.encoder_cache_dir: {folder} overlaps output.dir {output_dir}: the cache's files "
                "would be among the results; put the cache in a folder outside output.dir"
            )
    why = disk_layout.refusal(folder)
    if why is not None:
        raise UserError(why)


def _can_make_folder_in(folder: str) -> bool:
    """Whether a folder can be made in `folder`, by making one and removing it: permission bits do not tell
    for root (`os.access` says yes on /proc, or a read-only bind mount of some kinds, where nothing can be
    made), and the caches make folders there."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".batchvl-write-check-", dir=folder))
    except OSError:
        return False
    return True
