"""`folder` input: image and video files under directories; the key is the path relative to the folder.

A folder's files (sorted, recursive) are cut into shards of `input.files_per_shard`, so a folder of a
million files still commits and resumes in small units. Symlinks that lead outside the folder are
refused per file, like paths in tables.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator

from batchvl.config import InputConfig
from batchvl.errors import SampleError, UserError
from batchvl.io.paths import resolve_under_root
from batchvl.io.types import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaRef, Sample, ShardEnd, ShardInfo

MEDIA_SUFFIXES = tuple(f".{ext}" for ext in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)


def media_files(folder: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        found.extend(
            os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            for name in filenames
            if name.lower().endswith(MEDIA_SUFFIXES) and not name.startswith(".")
        )
    return sorted(found)


class FolderSource:
    def __init__(self, cfg: InputConfig):
        self.paths = cfg.paths
        self.files_per_shard = cfg.files_per_shard

    def list_shards(self) -> list[ShardInfo]:
        folders: list[str] = []
        for pattern in self.paths:
            matched = sorted(os.path.abspath(p) for p in glob.glob(pattern) if os.path.isdir(p))
            if not matched:
                raise UserError(f"input.paths: no folder matches '{pattern}'; check the path or glob")
            folders.extend(f for f in matched if f not in folders)
        common = os.path.commonpath(folders) if len(folders) > 1 else os.path.dirname(folders[0])
        shards = []
        for folder in folders:
            files = media_files(folder)
            name = os.path.relpath(folder, common).replace(os.sep, "/")
            for part, start in enumerate(range(0, len(files), self.files_per_shard)):
                members = tuple(files[start : start + self.files_per_shard])
                shards.append(ShardInfo(f"{name}/part-{part:05d}", folder, len(members), members))
        return shards

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]:
        root = os.path.realpath(shard.path)
        for index, relative in enumerate(shard.members):
            if not keep(index):
                continue
            sample = Sample(shard.shard, index, relative, [])
            try:
                kind = "video" if relative.lower().endswith(VIDEO_EXTENSIONS) else "image"
                sample.images = [MediaRef(None, resolve_under_root(relative, root), kind)]
            except SampleError as exc:
                sample.error = exc
            yield sample
        yield ShardEnd(shard.shard, len(shard.members))
