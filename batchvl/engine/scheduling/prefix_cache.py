"""Block hashes for prefix caching that know about images.

A full KV block is identified by a chain hash: (parent block's hash, the block's token ids, and for
every image whose placeholder run overlaps the block, where the run starts relative to the block and
the image's content hash). Two requests that share a system prompt and an image therefore share the
hashes, and so the cached K/V, of those blocks; the same text before a different image never matches,
because placeholder token ids are equal for every image and only the content hash tells them apart.
The chain makes a block's hash depend on everything before it, which is what its K/V depend on
(token ids, images, and through them the multimodal rope positions).
"""

from __future__ import annotations

import numpy as np
import xxhash

from batchvl.engine.request import Request

ROOT_HASH = 0


def block_hash(parent: int, token_ids: list[int], images: list[tuple[int, int, str]]) -> int:
    """Hash of one full block; `images` holds (run offset relative to the block, the run's first embedding
    row, content hash) of every placeholder run overlapping it."""
    digest = xxhash.xxh3_128()
    digest.update(parent.to_bytes(16, "little"))
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for offset, row_offset, content_hash in images:
        digest.update(offset.to_bytes(8, "little", signed=True))
        digest.update(row_offset.to_bytes(8, "little"))
        digest.update(content_hash.encode())
    return digest.intdigest()


def extend_block_hashes(request: Request, block_size: int, num_blocks: int) -> list[int]:
    """Make sure `request.block_hashes` covers its first `num_blocks` full blocks; returns that list.

    Hashes are computed once per request and kept, since a waiting request is matched against the
    cache every step until it is admitted."""
    hashes = request.block_hashes
    num_blocks = min(num_blocks, request.num_tokens // block_size)
    while len(hashes) < num_blocks:
        start = len(hashes) * block_size
        end = start + block_size
        images = [
            (span.offset - start, span.row_offset, span.content_hash)
            for span in request.images_overlapping(start, end)
        ]
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(block_hash(parent, request.token_ids(start, end), images))
    return hashes[:num_blocks]
