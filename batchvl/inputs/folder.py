"""`folder` input: image and video files under directories; the key is the path relative to the folder.

A folder's files are cut into shards of `input.files_per_shard`, so a folder of a million files still
commits and resumes in small units. Shard membership is recorded in the output folder
(`_batchvl/folder_shards/<folder>/part-NNNNN.json`, one file per shard) by the first run that lists it;
later runs keep every recorded shard as it is and put files that no recorded shard holds into new shards
numbered after them. So adding files never moves a file from one shard to another (which would skip it,
or caption it twice), a removed file's committed rows stay, and a renamed file is a new file. Each record
is created once (`OutputDir.create_exclusive`), so tasks of a Slurm array that list the folder at the
same time agree.

Symlinks that lead outside the folder are refused per file, like paths in tables.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator

from batchvl.config import InputConfig
from batchvl.errors import SampleError, UserError
from batchvl.inputs.paths import glob_base, relative_id, resolve_under_root, text_name
from batchvl.inputs.stamps import folder_stamp
from batchvl.inputs.types import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaRef, Sample, ShardEnd, ShardInfo
from batchvl.storage import layout
from batchvl.storage.output_dir import OutputDir

MEDIA_SUFFIXES = tuple(f".{ext}" for ext in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)
RECORD_ATTEMPTS = 20  # re-listings after another process recorded different shards at the same moment


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


def file_suffixes(folder: str) -> Counter[str]:
    """How many files of each suffix (lower case, '' for none) a folder holds, recursively: what it
    holds when it holds no media."""
    return Counter(
        os.path.splitext(name.lower())[1]
        for _, _, filenames in os.walk(folder)
        for name in filenames
        if not name.startswith(".")
    )


class ShardRecords:
    """The recorded shards of one input folder: part number -> its files."""

    def __init__(self, out: OutputDir, name: str):
        self.out = out
        self.folder = out.join(layout.FOLDER_SHARDS, name)

    def read(self) -> dict[int, tuple[str, ...]]:
        parts = {}
        for path in self.out.list(self.folder, "part-*.json"):
            number = os.path.basename(path).removeprefix("part-").removesuffix(".json")
            if number.isdigit():
                parts[int(number)] = self._members(path)
        return parts

    def create(self, number: int, members: tuple[str, ...]) -> bool:
        """Record a shard unless one of that number exists; True when it now holds exactly `members`."""
        path = self.out.join(self.folder, f"part-{number:05d}.json")
        if self.out.create_exclusive(path, json.dumps({"files": list(members)})):
            return True
        return self._members(path) == members  # another process recorded this number first

    def _members(self, path: str) -> tuple[str, ...]:
        return tuple(json.loads(self.out.read_text(path))["files"])


class FolderSource:
    def __init__(self, cfg: InputConfig, out: OutputDir | None = None, record: bool = False):
        """`out`: where shard membership is recorded (None: nothing recorded yet, nothing read);
        `record`: write the records of new shards (a run does; status, validate and report only look)."""
        self.paths = cfg.paths
        self.files_per_shard = cfg.files_per_shard
        self.out = out
        self.record = record and out is not None

    def list_shards(self) -> list[ShardInfo]:
        return [shard for folder, name in self._folders() for shard in self._folder_shards(folder, name)]

    def folders(self) -> list[str]:
        """The absolute folders the patterns match."""
        return [folder for folder, _ in self._folders()]

    def _folders(self) -> list[tuple[str, str]]:
        """(absolute folder, name) per matched folder; the name is relative to its pattern's base."""
        found: dict[str, str] = {}
        for pattern in self.paths:
            matched = sorted(os.path.abspath(p) for p in glob.glob(pattern) if os.path.isdir(p))
            if not matched:
                raise UserError(f"input.paths: no folder matches '{pattern}'; check the path or glob")
            for folder in matched:
                found.setdefault(folder, relative_id(folder, glob_base(pattern)))
        return sorted(found.items(), key=lambda item: item[1])

    def _folder_shards(self, folder: str, name: str) -> list[ShardInfo]:
        files = media_files(folder)
        records = ShardRecords(self.out, name) if self.out is not None else None
        for _ in range(RECORD_ATTEMPTS):
            recorded = records.read() if records is not None else {}
            known = {member for members in recorded.values() for member in members}
            new = [f for f in files if f not in known]
            first = max(recorded, default=-1) + 1
            proposed = {
                first + i: tuple(new[start : start + self.files_per_shard])
                for i, start in enumerate(range(0, len(new), self.files_per_shard))
            }
            if not self.record or all(records.create(n, members) for n, members in proposed.items()):
                break
        else:
            raise RuntimeError(f"could not record the shards of {folder}: they kept changing while listed")
        shards = {**recorded, **proposed}
        return [
            ShardInfo(
                f"{name}/part-{number:05d}",
                folder,
                len(members),
                members,
                stamp=folder_stamp(folder, members),
            )
            for number, members in sorted(shards.items())
        ]

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]:
        root = os.path.realpath(shard.path)
        for index, relative in enumerate(shard.members):
            if not keep(index):
                continue
            sample = Sample(shard.shard, index, text_name(relative), [])  # the file is opened by its name
            try:
                kind = "video" if relative.lower().endswith(VIDEO_EXTENSIONS) else "image"
                sample.images = [MediaRef(None, resolve_under_root(relative, root), kind)]
            except SampleError as exc:
                sample.error = exc
            yield sample
        yield ShardEnd(shard.shard, len(shard.members))


def missing_members(shard: ShardInfo) -> int:
    """Files of a recorded folder shard that are gone from the folder (removed or renamed since)."""
    return sum(not os.path.lexists(os.path.join(shard.path, member)) for member in shard.members)
