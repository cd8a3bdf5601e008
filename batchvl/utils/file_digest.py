"""The digest of a whole file's content, read in large pieces: what identifies a checkpoint's files and the
input files shards were made from (xxh3-128: some GB a second, far faster than the disks it reads)."""

from __future__ import annotations

import xxhash

PIECE = 16 << 20
# A file changed this recently may change again within its filesystem's timestamp tick, leaving its times as
# they were: a stamp of its times taken then does not stand for its content
RACY_S = 3.0


def file_digest(path: str) -> str:
    """The hex xxh3-128 digest of the file at `path`; raises OSError where it cannot be read."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        while piece := file.read(PIECE):
            digest.update(piece)
    return digest.hexdigest()
