"""The input formats, each a Source: list the shards, then stream one shard's samples.

`iter_shard(shard, keep)` yields the samples whose index `keep` accepts (a worker's part of the stream;
the rest are skipped as cheaply as the format allows) and ends with a `ShardEnd` giving the count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from batchvl.config import InputConfig, JobConfig
from batchvl.inputs.download import Downloader
from batchvl.inputs.fetch_ahead import FetchingSource
from batchvl.inputs.folder import FolderSource
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
