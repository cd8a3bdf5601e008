"""The last step of a family's image preprocessing, made where the vision tower is: 8-bit pixels rescaled,
less the mean and over the standard deviation of their channel, in float32, then cast to the tower's dtype.

The preprocessing workers stop at the resized (and cropped, tiled or patchified) 8-bit pixels, in the
layout the tower takes, channels first. Those are a quarter of the bytes of the normalized pixels in
bfloat16 and an eighth of float32, and half of that again for a still image of a Qwen-VL family, whose
temporal patch holds the image twice: made here, the copy is a repeat on the device. Every byte saved is
one fewer to write into shared memory, map in the job process, copy into the page-locked stack of a vision
call and send to the GPU; and the workers skip their costliest arithmetic. The arithmetic is the models'
image processors' (and was the workers'): `(x * rescale_factor - mean) / std`, each step rounded to
float32, so the tower's input is the same wherever it is made.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PixelNormalization:
    """How a tower's input is made from an item's 8-bit pixels: the image processor's numbers, and how many
    times each row repeats its values after the channel axis (a still image's temporal patch: Qwen-VL)."""

    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    repeat: int = 1

    @classmethod
    def of(cls, spec, repeat: int = 1) -> PixelNormalization:
        """From a family's preprocessing spec (its `rescale_factor`, `image_mean`, `image_std`)."""
        return cls(float(spec.rescale_factor), tuple(spec.image_mean), tuple(spec.image_std), repeat)

    def digest_bytes(self) -> bytes:
        """Its numbers, exactly: part of an item's content hash, since the same 8-bit pixels normalized
        otherwise are another tower input."""
        numbers = (self.rescale_factor, *self.image_mean, *self.image_std)
        return struct.pack(f"<{len(numbers)}dq", *numbers, self.repeat)


def image_processor_pixels(image_processor) -> dict:
    """What a family's spec takes of its image processor's pixel arithmetic: the resize filter (a PIL
    resampling filter) and the normalization's numbers."""
    return {
        "resample": int(image_processor.resample),
        "image_mean": tuple(float(v) for v in image_processor.image_mean),
        "image_std": tuple(float(v) for v in image_processor.image_std),
        "rescale_factor": float(image_processor.rescale_factor),
    }


def normalized_pixels(
    raw: torch.Tensor, normalization: PixelNormalization, dtype: torch.dtype, rows: int | None = None
) -> torch.Tensor:
    """uint8 `raw` items stacked along axis 0, channels on axis 1 ((rows, C * rest) patch rows or (frames,
    C, H, W)) -> the tower's input in `dtype` on `raw`'s device, each row's values repeated
    `normalization.repeat` times after its channel, then zero rows up to `rows` (default: none)."""
    count = len(raw)
    channels = len(normalization.image_mean)
    repeat = normalization.repeat
    row_shape = raw.shape[1:] if repeat == 1 else (raw[0].numel() * repeat,)
    values = raw.reshape(count, channels, 1, -1).to(torch.float32)
    values.mul_(normalization.rescale_factor)  # a float32 tensor's factor: rounded to float32, as numpy's
    values.sub_(_per_channel(normalization.image_mean, raw.device))
    values.div_(_per_channel(normalization.image_std, raw.device))
    total = count if rows is None else rows
    out = torch.empty((total, channels, repeat, values.shape[-1]), dtype=dtype, device=raw.device)
    out[:count].copy_(values.expand(count, channels, repeat, -1))
    out[count:].zero_()
    return out.view(total, *row_shape)


@functools.lru_cache(maxsize=16)
def _per_channel(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The channels' values as a tensor on `device`, not scalars, so that no kernel divides by multiplying
    with a reciprocal (CUDA's does for a scalar divisor), which rounds otherwise. Kept: made anew, each
    call's would be a copy to the device that waits for the GPU."""
    return torch.tensor(values, dtype=torch.float32, device=device).view(1, -1, 1, 1)
