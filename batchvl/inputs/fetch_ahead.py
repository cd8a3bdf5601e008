"""Samples whose media are URLs, downloaded ahead of preprocessing, several at a time, in input order.

It runs in each preprocessing worker, between its shard reader and its preprocessing: while the worker
decodes one sample, the next ones download on a few threads (the work is waiting on the network, so
threads are enough, and each worker bounds its own connections). A sample comes out with its downloads
possibly still under way; whoever uses its media first waits with `media_ready`, so that the wait is
part of that sample's work (the preprocessing watchdog's `preprocess.timeout_s` covers it).
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from batchvl.errors import SampleError
from batchvl.inputs.download import URL_SCHEMES, Downloader, DownloadStats
from batchvl.inputs.types import MediaRef, Sample, ShardEnd, ShardInfo

logger = logging.getLogger(__name__)


def with_downloaded_media(
    items: Iterable, downloader: Downloader, concurrency: int, pass_http_urls: bool = False
) -> Iterator:
    """The items in their order; a sample with URL media comes back with their downloads started
    (`media_ready` waits for their bytes in place, or the sample's error, and its `downloads` counts).
    Up to `concurrency` samples download at once: a sample waits to be handed out while the ones before
    it download, so one whose server is slow holds the ones after it back for at most its timeouts."""
    fetched = functools.partial(is_fetched, pass_http_urls=pass_http_urls)
    with ThreadPoolExecutor(concurrency, thread_name_prefix="batchvl-download") as pool:
        window: deque = deque()
        for item in items:
            if not window and not has_urls(item, fetched):  # nothing to keep in order behind: no wait
                yield item
                continue
            if has_urls(item, fetched):
                item.fetching = pool.submit(download_media, item, downloader, fetched)
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


def is_fetched(url: str | None, pass_http_urls: bool = False) -> bool:
    """Whether batchvl downloads a media URL: always, but for an http(s) one a server fetches itself."""
    return url is not None and not (pass_http_urls and url[:8].lower().startswith(URL_SCHEMES))


def has_urls(item, fetched: Callable[[str | None], bool] = is_fetched) -> bool:
    return isinstance(item, Sample) and item.error is None and any(fetched(ref.url) for ref in item.images)


def download_media(
    sample: Sample, downloader: Downloader, fetched: Callable[[str | None], bool] = is_fetched
) -> Sample:
    stats = DownloadStats()
    refs: list[MediaRef] = []
    url = None
    try:
        for ref in sample.images:
            url = ref.url
            refs.append(MediaRef(downloader.fetch(url, stats), None, ref.kind, url) if fetched(url) else ref)
        sample.images = refs
    except SampleError as exc:  # the sample's first failed download is its error
        sample.error = exc
    except Exception as exc:  # bad input must never end the job; keep the traceback for debugging
        logger.debug("downloading %s for %s/%s failed", url, sample.shard, sample.key, exc_info=True)
        sample.error = SampleError("download_error", f"{url}: {type(exc).__name__}: {exc}")
    sample.downloads = stats
    return sample


class FetchingSource:
    """A table source whose URL media are downloaded as its shards are read (in the worker reading them)."""

    def __init__(self, source, downloader: Downloader, concurrency: int, pass_http_urls: bool = False):
        self.source = source
        self.downloader = downloader
        self.concurrency = concurrency
        self.pass_http_urls = pass_http_urls

    def list_shards(self) -> list[ShardInfo]:
        return self.source.list_shards()

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]:
        samples = self.source.iter_shard(shard, keep)
        return with_downloaded_media(samples, self.downloader, self.concurrency, self.pass_http_urls)
