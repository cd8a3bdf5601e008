"""The input formats, each a Source: list the shards, then stream one shard's samples.

`iter_shard(shard, keep)` yields the samples whose index `keep` accepts (a worker's part of the stream;
the rest are skipped as cheaply as the format allows) and ends with a `ShardEnd` giving the count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Protocol

from batchvl.config import InputConfig, JobConfig
from batchvl.errors import UserError
from batchvl.inputs.download import Downloader
from batchvl.inputs.fetch_ahead import FetchingSource
from batchvl.inputs.folder import FolderSource, file_suffixes
from batchvl.inputs.hf_dataset import HFDatasetSource
from batchvl.inputs.openai_batch import OpenAIBatchSource
from batchvl.inputs.parquet import ParquetSource
from batchvl.inputs.types import Sample, ShardEnd, ShardInfo
from batchvl.inputs.webdataset import WebDatasetSource
from batchvl.storage.output_dir import OutputDir


class Source(Protocol):
    def list_shards(self) -> list[ShardInfo]: ...

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]: ...


SOURCES = {
    "parquet": ParquetSource,
    "webdataset": WebDatasetSource,
    "hf_dataset": HFDatasetSource,
    "folder": FolderSource,
    "openai_batch": OpenAIBatchSource,
}


# The format that reads a file of this suffix: what to suggest for a folder that holds such files instead
# of images or videos.
FORMAT_OF_SUFFIX = {
    ".parquet": "parquet",
    ".tar": "webdataset",
    ".tgz": "webdataset",
    ".jsonl": "openai_batch",
    ".arrow": "hf_dataset",
}


def make_source(
    cfg: InputConfig, out: OutputDir | None = None, record: bool = False, pass_http_urls: bool = False
) -> Source:
    """The reader of `cfg`'s format. `out` holds what a format records about its shards (the `folder`
    format's membership); `record` lets the listing write it (a run does, before any work)."""
    if cfg.format == "folder":
        return FolderSource(cfg, out, record)
    # Table cells and request messages may hold image URLs: they are downloaded as the shard is read, but
    # for http(s) URLs a server fetches itself (`pass_http_urls`).
    downloader = Downloader(cfg.download, cfg.storage_options)
    return FetchingSource(SOURCES[cfg.format](cfg), downloader, cfg.download.concurrency, pass_http_urls)


def job_source(cfg: JobConfig, record: bool = False, pass_http_urls: bool = False) -> Source:
    return make_source(cfg.input, OutputDir.of(cfg.output), record, pass_http_urls)


def check_has_samples(source: Source, listing: list[ShardInfo]) -> None:
    """Refuse inputs that hold no sample at all (a wrong folder, a wrong format): a run would do nothing
    and end as if it had done its work. A shard whose count only reading tells (a tar file) may hold some."""
    if any(shard.num_rows != 0 for shard in listing):
        return
    if isinstance(source, FolderSource):
        raise UserError(_no_media_message(source.folders()))
    names = ", ".join(shard.path for shard in listing[:3]) + (", ..." if len(listing) > 3 else "")
    raise UserError(f"input.paths: the {len(listing)} input shard(s) hold no rows ({names}); nothing to run")


def _no_media_message(folders: list[str]) -> str:
    where = folders[0] + (f" and {len(folders) - 1} other folder(s)" if len(folders) > 1 else "")
    suffixes = sum((file_suffixes(folder) for folder in folders), Counter())
    message = f"input.paths: the folder reader found no image or video under {where} ({_holding(suffixes)})"
    known = [suffix for suffix, _ in suffixes.most_common() if suffix in FORMAT_OF_SUFFIX]
    if known:
        return f"{message}; set input.format: {FORMAT_OF_SUFFIX[known[0]]}"
    return f"{message}; point input.paths at folders of images or videos"


def _holding(suffixes: Counter[str]) -> str:
    """'it holds 3 .parquet files, 1 .txt file' (the three most common suffixes, then how many others)."""
    if not suffixes:
        return "it holds no file"
    kinds = [
        f"{count} {suffix or 'suffixless'} file{'s' if count > 1 else ''}"
        for suffix, count in suffixes.most_common(3)
    ]
    others = suffixes.total() - sum(count for _, count in suffixes.most_common(3))
    return "it holds " + ", ".join(kinds) + (f" and {others} other file(s)" if others else "")
