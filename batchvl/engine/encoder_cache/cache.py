"""The encoder cache: an image's embedding from memory, else from the disk cache, else from the vision tower.

One object owns the three tiers. The scheduler decides which images of a step are memory hits through the
cache's bookkeeping (`entries`: hashes, holders and sizes only, `bookkeeping.py`); `fetch` serves the
misses from disk (`disk.py`, when `engine.encoder_cache_dir` is set) and encodes the rest, storing what it
encoded on disk for later runs; `drop` forgets the tensors of the entries the bookkeeping evicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from batchvl.config import EngineConfig
from batchvl.engine.adapter import ModelAdapter
from batchvl.engine.device.sync import synchronize
from batchvl.engine.encoder_cache import disk_layout
from batchvl.engine.encoder_cache.bookkeeping import EncoderCacheManager
from batchvl.engine.encoder_cache.disk import EncoderDiskCache
from batchvl.engine.encoder_cache.vision_digest import vision_digest
from batchvl.preprocess.media import PreparedMedia
from batchvl.utils.memory import GB, MB

EncodeImages = Callable[[list[PreparedMedia]], list[torch.Tensor]]


class EncoderCache:
    def __init__(
        self,
        capacity_bytes: int,
        encode: EncodeImages,
        device: torch.device,
        disk: EncoderDiskCache | None = None,
    ):
        self.entries = EncoderCacheManager(capacity_bytes)
        self.embeddings: dict[str, torch.Tensor] = {}  # content hash -> embedding rows, on the device
        self.disk = disk
        self._encode = encode
        self._device = device
        self.images_encoded = 0
        self.patches_encoded = 0
        self.encode_s = 0.0  # in the vision tower, its kernels done

    def fetch(self, images: list[PreparedMedia], wait: bool = True) -> dict[str, int]:
        """Put the embeddings of `images` (memory misses) in memory, from disk where it holds them, else
        encoded; returns the bytes of each, by content hash, for the bookkeeping. An overlapped step does
        not `wait` for the vision tower's kernels (its `encode_s` is then their launch): the step's forward
        reads the embeddings after them on the same stream."""
        sizes = self._load_from_disk(images)
        missing = [image for image in images if image.content_hash not in sizes]
        if missing:
            started = time.perf_counter()
            embeddings = self._encode(missing)
            if wait:
                synchronize(self._device)  # the vision tower's kernels done, not just launched
            self.encode_s += time.perf_counter() - started
            self.images_encoded += len(missing)
            self.patches_encoded += sum(image.num_patches for image in missing)
            for image, embedding in zip(missing, embeddings, strict=True):
                sizes[image.content_hash] = self._keep(image.content_hash, embedding)
                if self.disk is not None:
                    self.disk.store(image.content_hash, embedding)
        return sizes

    def drop(self, hashes: list[str]) -> None:
        """Forget the tensors of entries the bookkeeping evicted."""
        for content_hash in hashes:
            del self.embeddings[content_hash]

    def check_integrity(self, live_requests: set[int], pending_freed: list[str]) -> None:
        """Assert the bookkeeping is whole and the tensors held are its entries and the evicted ones not
        yet dropped."""
        self.entries.check_integrity(live_requests)
        kept = self.entries.cached_hashes | set(pending_freed)
        assert set(self.embeddings) == kept, "the embeddings held differ from the cache's entries"

    def _load_from_disk(self, images: list[PreparedMedia]) -> dict[str, int]:
        sizes: dict[str, int] = {}
        if self.disk is None:
            return sizes
        for image in images:
            embedding = self.disk.load(image.content_hash)
            if embedding is not None:
                sizes[image.content_hash] = self._keep(image.content_hash, embedding.to(self._device))
        return sizes

    def _keep(self, content_hash: str, embedding: torch.Tensor) -> int:
        self.embeddings[content_hash] = embedding
        return embedding.numel() * embedding.element_size()


def build_encoder_cache(config: EngineConfig, adapter: ModelAdapter, encode: EncodeImages) -> EncoderCache:
    """The cache of `engine.encoder_cache_mb` in memory, over the disk cache in `engine.encoder_cache_dir`
    (entries of this model's vision tower only) where one is set."""
    disk = None
    folder = config.encoder_cache_dir
    if folder is not None:
        disk_layout.adopt(folder)  # before the digest is remembered in it: refused if not the cache's
        disk = EncoderDiskCache(folder, int(config.encoder_cache_dir_gb * GB), vision_digest(adapter, folder))
    return EncoderCache(int(config.encoder_cache_mb * MB), encode, adapter.device, disk)
