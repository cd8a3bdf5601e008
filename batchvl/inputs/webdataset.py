"""`webdataset` input: tar shards whose members are grouped into samples by key.

The WebDataset convention: a member `dir/abc.left.jpg` belongs to the sample with key `dir/abc` and
has the extension `left.jpg`. Image and video members become the sample's media (in member order);
`json` members (their scalar values), `txt` and `cls` become fields a prompt can use.

Read with the standard library's tarfile rather than the webdataset package: a truncated tar must keep
the samples read before the damage and report the one it cut, which needs control over the member loop.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Callable, Iterator

from batchvl.config import InputConfig
from batchvl.errors import SampleError
from batchvl.inputs.paths import stream_shards, text_name
from batchvl.inputs.types import (
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    MediaRef,
    Sample,
    ShardEnd,
    ShardInfo,
    is_scalar,
)
from batchvl.storage.remote import is_remote, open_input

SUFFIXES = (".tar", ".tar.gz", ".tgz")
END_OF_ARCHIVE = 1024  # two zero blocks; a tar cut at a member boundary lacks them


def split_name(name: str) -> tuple[str, str]:
    """'dir/abc.left.jpg' -> ('dir/abc', 'left.jpg'); a name that is not UTF-8 as `text_name` writes it."""
    folder, _, base = text_name(name).rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


class _Group:
    def __init__(self, key: str, index: int):
        self.key = key
        self.index = index
        self.members: list[tuple[str, bytes | SampleError]] = []  # (extension, data or why it has none)


def member_data(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes | SampleError:
    """A member's bytes: a file's, or for a hard or symbolic link the bytes of the member it names in the
    same tar (`tar cf` stores a file seen twice as a hard link); why there are none, for the sample's error
    row: a link to what the tar does not hold (the file system is never read), a pipe or a device."""
    name = text_name(member.name)
    if not (member.isfile() or member.islnk() or member.issym()):
        return SampleError("not_a_file", f"member '{name}' is a named pipe or a device, not a file")
    try:
        return tar.extractfile(member).read()
    except KeyError:
        target = text_name(member.linkname)
        message = f"member '{name}' links to '{target}', which the tar does not hold"
        return SampleError("file_not_found", message)


def _sample(shard: str, group: _Group) -> Sample:
    sample = Sample(shard, group.index, group.key, [])
    try:
        for ext, data in group.members:
            if isinstance(data, SampleError):
                raise data
            last = ext.rsplit(".", 1)[-1]
            if last in IMAGE_EXTENSIONS:
                sample.images.append(MediaRef(data, None, "image"))
            elif last in VIDEO_EXTENSIONS:
                sample.images.append(MediaRef(data, None, "video"))
            elif last == "json":
                try:
                    values = json.loads(data)
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise SampleError(
                        "bad_json", f"member '{group.key}.{ext}' is not valid JSON: {exc}"
                    ) from exc
                if isinstance(values, dict):
                    sample.fields.update({k: v for k, v in values.items() if is_scalar(v)})
            elif last in ("txt", "cls"):
                text = data.decode("utf-8", errors="replace").strip()
                sample.fields[ext] = int(text) if last == "cls" and text.lstrip("-").isdigit() else text
        if not sample.images:
            raise SampleError("missing_image", f"sample '{group.key}' has no image or video member")
    except SampleError as exc:
        sample.error = exc
    return sample


class WebDatasetSource:
    def __init__(self, cfg: InputConfig):
        self.paths = cfg.paths
        self.storage_options = cfg.storage_options

    def list_shards(self) -> list[ShardInfo]:
        return stream_shards(self.paths, SUFFIXES, "tar files", self.storage_options)

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]:
        group: _Group | None = None
        count = 0
        damage: str | None = None
        try:
            with (
                open_input(shard.path, self.storage_options) as stream,
                tarfile.open(fileobj=stream, mode="r:*") as tar,
            ):
                for member in tar:
                    if member.isdir():
                        continue
                    key, ext = split_name(member.name)
                    if group is None or key != group.key:
                        if group is not None and keep(group.index):
                            yield _sample(shard.shard, group)
                        group = _Group(key, count)
                        count += 1
                    if keep(group.index):  # other workers' members are skipped without reading them
                        group.members.append((ext, member_data(tar, member)))
                uncompressed = not shard.path.endswith((".gz", ".tgz"))
                size = stream.size if is_remote(shard.path) else os.path.getsize(shard.path)
                if uncompressed and size - tar.offset < END_OF_ARCHIVE:
                    damage = "the file ends without the end-of-archive marker"
        except (tarfile.TarError, EOFError, OSError) as exc:
            # one line: tarfile lists each compression it tried on a line of its own
            damage = "; ".join(line.strip("- ") for line in str(exc).splitlines()) or type(exc).__name__
        if group is not None and keep(group.index):
            sample = _sample(shard.shard, group)
            if damage is not None:
                sample.error = SampleError(
                    "truncated_shard",
                    f"tar file is damaged ({damage}); this sample was the last one read and may be "
                    "incomplete; samples after it could not be read",
                )
            yield sample
        if damage is not None and group is None:
            # Nothing readable at all: one error row says so rather than an empty output that looks fine.
            count = 1
            if keep(0):
                message = f"tar file has no readable sample: {damage}"
                yield Sample(shard.shard, 0, "", [], error=SampleError("truncated_shard", message))
        yield ShardEnd(shard.shard, count)
