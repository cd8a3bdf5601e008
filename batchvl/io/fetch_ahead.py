"""Samples whose media are URLs, downloaded ahead of preprocessing, several at a time, in input order.

It runs in each preprocessing worker, between its shard reader and its preprocessing: while the worker
decodes one sample, the next ones download on a few threads (the work is waiting on the network, so
threads are enough, and each worker bounds its own connections).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from batchvl.errors import SampleError
from batchvl.io.download import Downloader, DownloadStats
from batchvl.io.types import MediaRef, Sample, ShardEnd, ShardInfo


def with_downloaded_media(items: Iterable, downloader: Downloader, concurrency: int) -> Iterator:
    """The items in their order; a sample with URL media comes back with their bytes in place (or with
    its error set) and its `downloads` counts. Up to `concurrency` samples download at once; one whose
    server is slow holds the ones after it back for at most its timeouts."""
    with ThreadPoolExecutor(concurrency, thread_name_prefix="batchvl-download") as pool:
        window: deque = deque()
        for item in items:
            if not window and not has_urls(item):  # nothing to keep in order behind: no wait
                yield item
                continue
            window.append(pool.submit(download_media, item, downloader) if has_urls(item) else item)
            if len(window) >= concurrency:
                yield _ready(window.popleft())
        while window:
            yield _ready(window.popleft())


def has_urls(item) -> bool:
    return isinstance(item, Sample) and item.error is None and any(ref.url for ref in item.images)


def download_media(sample: Sample, downloader: Downloader) -> Sample:
    stats = DownloadStats()
    fetched: list[MediaRef] = []
    try:
        for ref in sample.images:
            data = downloader.fetch(ref.url, stats) if ref.url else None
            fetched.append(MediaRef(data, None, ref.kind, ref.url) if ref.url else ref)
        sample.images = fetched
    except SampleError as exc:  # the sample's first failed download is its error
        sample.error = exc
    sample.downloads = stats
    return sample


def _ready(entry):
    return entry.result() if isinstance(entry, Future) else entry


class FetchingSource:
    """A table source whose URL media are downloaded as its shards are read (in the worker reading them)."""

    def __init__(self, source, downloader: Downloader, concurrency: int):
        self.source = source
        self.downloader = downloader
        self.concurrency = concurrency

    def list_shards(self) -> list[ShardInfo]:
        return self.source.list_shards()

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]:
        return with_downloaded_media(self.source.iter_shard(shard, keep), self.downloader, self.concurrency)
