"""Samples whose media are URLs, downloaded ahead of preprocessing, several at a time, in input order.

It runs in each preprocessing worker, between its shard reader and its preprocessing: while the worker
decodes one sample, the next ones download on a few threads (the work is waiting on the network, so
threads are enough, and each worker bounds its own connections). A sample comes out with its downloads
possibly still under way; whoever uses its media first waits with `media_ready`, so that the wait is
part of that sample's work (the preprocessing watchdog's `preprocess.timeout_s` covers it).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from batchvl.errors import SampleError
from batchvl.inputs.download import Downloader, DownloadStats
from batchvl.inputs.types import MediaRef, Sample, ShardEnd, ShardInfo

logger = logging.getLogger(__name__)


def with_downloaded_media(items: Iterable, downloader: Downloader, concurrency: int) -> Iterator:
    """The items in their order; a sample with URL media comes back with their downloads started
    (`media_ready` waits for their bytes in place, or the sample's error, and its `downloads` counts).
    Up to `concurrency` samples download at once: a sample waits to be handed out while the ones before
    it download, so one whose server is slow holds the ones after it back for at most its timeouts."""
    with ThreadPoolExecutor(concurrency, thread_name_prefix="batchvl-download") as pool:
        window: deque = deque()
        for item in items:
            if not window and not has_urls(item):  # nothing to keep in order behind: no wait
                yield item
                continue
            if has_urls(item):
                item.fetching = pool.submit(download_media, item, downloader)
            window.append(item)
            if len(window) >= concurrency:
                yield window.popleft()
        yield from window


def media_ready(sample: Sample) -> Sample:
    """`sample` once the downloads of its media are done (at once if it has none under way)."""
    if sample.fetching is not None:
        sample.fetching.result()
        sample.fetching = None
    return sample


def has_urls(item) -> bool:
    return isinstance(item, Sample) and item.error is None and any(ref.url for ref in item.images)


def download_media(sample: Sample, downloader: Downloader) -> Sample:
    stats = DownloadStats()
    fetched: list[MediaRef] = []
    url = None
    try:
        for ref in sample.images:
            url = ref.url
            data = downloader.fetch(url, stats) if url else None
            fetched.append(MediaRef(data, None, ref.kind, url) if url else ref)
        sample.images = fetched
    except SampleError as exc:  # the sample's first failed download is its error
        sample.error = exc
    except Exception as exc:  # bad input must never end the job; keep the traceback for debugging
        logger.debug("downloading %s for %s/%s failed", url, sample.shard, sample.key, exc_info=True)
        sample.error = SampleError("download_error", f"{url}: {type(exc).__name__}: {exc}")
    sample.downloads = stats
    return sample


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
