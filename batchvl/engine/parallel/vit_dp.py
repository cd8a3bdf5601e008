"""ViT data parallelism under torch.distributed: the images of an encode step are split across ranks.

Rank 0 runs the job (scheduler, language model, writer). Whenever it has images to encode it assigns
them to ranks by greedy longest-processing-time on patch counts (`lpt_assignment`), sends each rank its
share, encodes its own, and all-gathers the embeddings (padded to the longest share), which it puts back
in the original order. The other ranks hold a replica of the model and serve encode rounds until rank 0
says stop (`serve_encode_rounds`). Launched by `torchrun --nproc-per-node N -m batchvl run job.yaml`
with `engine.vit_parallel: data`: gloo on CPU, nccl on GPUs of their own, gloo again where ranks share a
GPU (NCCL refuses two ranks of a group on one GPU; gloo copies CUDA tensors through the host).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchvl.errors import UserError
from batchvl.preprocess.media import PreparedMedia
from batchvl.utils.balance import lpt_assignment

logger = logging.getLogger(__name__)

# Encodes one rank's share; returns one embedding per image, in the order given.
LocalEncode = Callable[[list[PreparedMedia]], list[torch.Tensor]]


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def process_group_backend(device: torch.device, shares_its_gpu: bool) -> str:
    """From the resolved device, never the config's word for it: `auto` may be CUDA."""
    return "nccl" if device.type == "cuda" and not shares_its_gpu else "gloo"


def init_distributed(device: torch.device, shares_its_gpu: bool = False) -> DistributedContext:
    """Join the process group torchrun set up, on this rank's resolved device (`devices.process_device`)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise UserError("this torch build has no torch.distributed; run without torchrun")
    if not dist.is_initialized():
        if device.type == "cuda":
            # The rank's own GPU becomes its current one: collectives and every `cuda` tensor without
            # an index go there, not to GPU 0.
            torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend(device, shares_its_gpu))
    return DistributedContext(dist.get_rank(), dist.get_world_size())


class DataParallelEncoder:
    """Rank 0's side of an encode round."""

    def __init__(self, context: DistributedContext, local_encode: LocalEncode, device: torch.device):
        self.context = context
        self.local_encode = local_encode
        self.device = device
        self.patches_per_rank = [0] * context.world_size

    def encode(self, images: list[PreparedMedia]) -> list[torch.Tensor]:
        import torch.distributed as dist

        shares = lpt_assignment([img.num_patches for img in images], self.context.world_size)
        for rank, share in enumerate(shares):
            self.patches_per_rank[rank] += sum(images[i].num_patches for i in share)
        # the serving ranks' pixels (rank 0's own share never leaves it), as bytes of the longest share's
        pixels = [[images[i].pixel_values for i in share] for share in shares[1:]]
        longest = max(1, *(sum(array.nbytes for array in share) for share in pixels))
        serving = [("encode", longest, [_described(images[i]) for i in share]) for share in shares[1:]]
        dist.scatter_object_list([None], [("encode", longest, [])] + serving, src=0)  # rank 0's: unread
        _scatter_pixels(pixels, longest, self.device)
        gathered = _encode_and_gather(self.local_encode, [images[i] for i in shares[0]], self.device)
        out: list[torch.Tensor | None] = [None] * len(images)
        for share, embeddings in zip(shares, gathered, strict=True):
            for index, embedding in zip(share, embeddings, strict=True):
                out[index] = embedding
        return out


def release_serving_ranks(world_size: int) -> None:
    """Rank 0, once, when the job is over or has failed: tell the serving ranks to stop."""
    import torch.distributed as dist

    dist.scatter_object_list([None], [("stop", 0, None)] * world_size, src=0)


def leave_process_group() -> None:
    """Every rank, last: wait for all ranks to be done with the group, then tear it down together.

    Without the barrier a rank could tear down its connections while a peer is still finishing the
    last exchange, and gloo then aborts the process at exit.
    """
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def serve_encode_rounds(local_encode: LocalEncode, device: torch.device) -> int:
    """A serving rank's loop: encode its share of each round until rank 0 says stop; returns rounds served."""
    import torch.distributed as dist

    rounds = 0
    while True:
        received: list = [None]
        dist.scatter_object_list(received, None, src=0)
        op, longest, described = received[0]
        if op == "stop":
            return rounds
        _encode_and_gather(local_encode, _receive_pixels(described, longest, device), device)
        rounds += 1


# An image's pixels leave rank 0 as bytes of one tensor per rank (`_scatter_pixels`), not in the pickled
# message: pickling copies them twice more, and NCCL moves a tensor GPU to GPU. The message says how to
# cut them up again: the image without its pixels, their shape and dtype.
_NO_PIXELS = np.empty(0, dtype=np.uint8)


def _described(image: PreparedMedia) -> tuple[PreparedMedia, tuple[int, ...], torch.dtype]:
    pixels = torch.as_tensor(image.pixel_values)  # (bfloat16 pixels are a tensor already: media.py)
    return dataclasses.replace(image, pixel_values=_NO_PIXELS), tuple(pixels.shape), pixels.dtype


def _transport_device(device: torch.device) -> torch.device:
    """NCCL moves only GPU tensors; gloo here moves host ones."""
    import torch.distributed as dist

    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _scatter_pixels(
    pixels: list[list[np.ndarray | torch.Tensor]], longest: int, device: torch.device
) -> None:
    """Rank 0: each serving rank's pixels (ranks 1, 2, ...), as one byte tensor padded to `longest`, in one
    scatter; rank 0's own slot is an unread buffer of that size."""
    import torch.distributed as dist

    transport = _transport_device(device)
    own = torch.empty(longest, dtype=torch.uint8, device=transport)
    padded = [own]
    for share in pixels:
        buffer = torch.zeros(longest, dtype=torch.uint8)
        if share:
            flat = torch.cat([_bytes_of(array) for array in share])
            buffer[: flat.numel()] = flat
        padded.append(buffer.to(transport))
    dist.scatter(own, padded, src=0)


def _bytes_of(pixels: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The pixels' bytes, flat, as uint8."""
    return torch.as_tensor(pixels).contiguous().reshape(-1).view(torch.uint8)


def _receive_pixels(
    described: list[tuple[PreparedMedia, tuple[int, ...], torch.dtype]], longest: int, device: torch.device
) -> list[PreparedMedia]:
    """A serving rank: its share's pixels from `_scatter_pixels`, put back into its images as tensors (on
    the host from gloo; over NCCL, already on this rank's GPU), which the vision tower takes as they are."""
    import torch.distributed as dist

    received = torch.empty(longest, dtype=torch.uint8, device=_transport_device(device))
    dist.scatter(received, None, src=0)
    return _images_from_bytes(described, received)


def _images_from_bytes(
    described: list[tuple[PreparedMedia, tuple[int, ...], torch.dtype]], received: torch.Tensor
) -> list[PreparedMedia]:
    """The described images with their pixels cut from `received`, their bytes one after another."""
    images, offset = [], 0
    for image, shape, dtype in described:
        size = math.prod(shape) * dtype.itemsize
        piece = received[offset : offset + size]
        if offset % dtype.itemsize:  # a view as `dtype` must start at a multiple of its size
            piece = piece.clone()
        pixels = piece.view(dtype).view(shape)
        offset += size
        images.append(dataclasses.replace(image, pixel_values=pixels))
    return images


def _encode_and_gather(
    local_encode: LocalEncode, images: list[PreparedMedia], device: torch.device
) -> list[list[torch.Tensor]]:
    """Encode this rank's share, then all-gather every rank's embeddings; returns them per rank."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    embeddings = local_encode(images) if images else []
    # Row counts per image, and (hidden size, dtype) from each rank that encoded something, so every
    # rank can size the padded exchange.
    mine_meta = (
        [int(e.shape[0]) for e in embeddings],
        (int(embeddings[0].shape[1]), str(embeddings[0].dtype).removeprefix("torch."))
        if embeddings
        else None,
    )
    metas: list = [None] * world_size
    dist.all_gather_object(metas, mine_meta)
    hidden, dtype_name = next(shape for _, shape in metas if shape is not None)
    longest = max(sum(rows) for rows, _ in metas)
    mine = torch.zeros((longest, hidden), dtype=getattr(torch, dtype_name), device=device)
    if embeddings:
        flat = torch.cat(embeddings)
        mine[: flat.shape[0]] = flat
    buffers = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(buffers, mine)
    return [
        list(torch.split(buffer[: sum(rows)], rows)) if rows else []
        for buffer, (rows, _) in zip(buffers, metas, strict=True)
    ]
