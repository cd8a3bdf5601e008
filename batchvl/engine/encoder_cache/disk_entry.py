"""One entry of the encoder disk cache as bytes: a header, the embedding's raw bytes, and a checksum.

    magic (8 bytes) | header length (uint32, little-endian) | header (JSON: key, dtype, shape) | payload
    | xxh3-128 of everything before it (16 bytes)

The checksum covers the header and the payload, so a truncated file (a writer killed midway, a disk that
filled up), a flipped byte or a file of another key is refused as a whole: `decode_entry` gives None and
the image is encoded again. Plain bytes rather than a tensor file format, so that checking an entry is
one hash over what was read.
"""

from __future__ import annotations

import json
import math
import struct

import torch
import xxhash

MAGIC = b"BVLEMB01"  # the format's version is its last two bytes: a new layout is a new magic
_HEAD = struct.Struct("<8sI")
_CHECKSUM_BYTES = 16
_ALIGN = 64


def encode_entry(key: str, embedding: torch.Tensor) -> bytes:
    """The entry of `embedding` under `key`, as the bytes of its file."""
    tensor = embedding.detach().to("cpu").contiguous()
    payload = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {"key": key, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    ).encode()
    # Spaces after the JSON start the payload on a 64-byte boundary: the tensor read back in place is
    # aligned as kernels expect of a tensor they did not allocate.
    header += b" " * (-(_HEAD.size + len(header)) % _ALIGN)
    body = _HEAD.pack(MAGIC, len(header)) + header + payload
    return body + xxhash.xxh3_128_digest(body)


def decode_entry(key: str, data: bytearray) -> torch.Tensor | None:
    """The embedding an entry's bytes hold (sharing `data`), or None when they are not a whole entry of
    `key` in this format."""
    if len(data) < _HEAD.size + _CHECKSUM_BYTES:
        return None
    body = memoryview(data)[:-_CHECKSUM_BYTES]
    if xxhash.xxh3_128_digest(body) != bytes(data[-_CHECKSUM_BYTES:]):
        return None
    magic, header_length = _HEAD.unpack_from(body)
    if magic != MAGIC:
        return None
    try:
        header = json.loads(bytes(body[_HEAD.size : _HEAD.size + header_length]))
        dtype = getattr(torch, header["dtype"])
        shape = [int(size) for size in header["shape"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    payload = body[_HEAD.size + header_length :]
    if header["key"] != key or not isinstance(dtype, torch.dtype):
        return None
    if len(payload) != math.prod(shape) * dtype.itemsize or not payload:
        return None
    return torch.frombuffer(payload, dtype=dtype).reshape(shape)
