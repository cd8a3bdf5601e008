"""Records that cross the reader boundary: shards and not-yet-decoded samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchvl.errors import SampleError

if TYPE_CHECKING:
    from concurrent.futures import Future

    import pyarrow as pa

    from batchvl.inputs.download import DownloadStats

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
VIDEO_EXTENSIONS = ("mp4", "webm", "avi", "mkv", "mov")


@dataclass(frozen=True)
class MediaRef:
    """One image or video of a sample, not decoded yet: encoded bytes, a checked absolute path, or an
    http(s) URL (downloaded in the preprocessing worker, then held as bytes with the URL kept for
    messages)."""

    data: bytes | None
    path: str | None
    kind: str = "image"  # "image" or "video"
    url: str | None = None


@dataclass(frozen=True)
class ShardInfo:
    shard: str  # id: the input path relative to its pattern's folder (`glob_base`); names its output file
    path: str  # absolute input path (for `folder` input: the folder)
    num_rows: int | None  # None where only reading the shard tells (tar files)
    members: tuple[str, ...] = ()  # `folder` input: the files of this shard, relative to `path`
    columns: tuple[str, ...] | None = None  # table inputs: the column names (None: known only by reading)
    column_types: tuple[pa.DataType, ...] | None = field(default=None, compare=False)  # their Arrow types
    # The input's version as listed (`stamps.py`: a file's, or a `folder` shard's files'; None: not known)
    stamp: dict | None = field(default=None, hash=False)


@dataclass(frozen=True)
class ChatRequest:
    """One chat-completion request of an `openai_batch` line: its messages in the chat template's form
    (image parts as `{"type": "image"}`, in the order of the sample's media) and its own sampling, where
    it sets it (None: the job's)."""

    messages: tuple[dict, ...]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None
    json_schema: dict | None = (
        None  # from response_format: json_schema, or {"type": "object"} for json_object
    )


@dataclass
class Sample:
    shard: str
    index: int  # position within the shard (input order)
    key: str
    images: list[MediaRef]
    fields: dict[str, Any] = field(default_factory=dict)  # other scalar values, passed through
    error: SampleError | None = None  # the sample itself is unusable: becomes error rows downstream
    downloads: DownloadStats | None = None  # what fetching its URL media did (None: it has none)
    chat: ChatRequest | None = None  # an openai_batch request: its messages replace the job's prompts
    fetching: Future | None = None  # its URL media still downloading (`fetch_ahead.media_ready` waits)


@dataclass(frozen=True)
class ShardSkipped:
    """Emitted instead of a shard's samples when another run has it: claimed, or committed meanwhile."""

    shard: str
    reason: str


@dataclass(frozen=True)
class ShardEnd:
    """Emitted after a shard's last sample: how many samples it held (errors included)."""

    shard: str
    num_samples: int


def is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)
