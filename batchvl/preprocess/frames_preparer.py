"""MediaRef -> PreparedMedia for the families whose video is a series of frames, each one tile of the tower
(SmolVLM2, InternVL): an image by the family's image rule; a video's frames chosen by the family's rule,
decoded, and prepared together. Picklable for worker processes."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from batchvl.inputs.types import MediaRef
from batchvl.preprocess.image import decode_image
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.video import ClipFrames, decode_frames


@dataclass(frozen=True)
class FramesPreparer:
    """A family's subclass gives the three rules; its settings are its own fields."""

    max_image_pixels: int

    def __call__(self, ref: MediaRef) -> PreparedMedia:
        if ref.kind == "video":
            clip = decode_frames(ref.data, ref.path, self.choose_frames, self.max_image_pixels)
            return self.prepare_frames(clip)
        return self.prepare_image(decode_image(ref.data, ref.path, self.max_image_pixels))

    def choose_frames(self, total_frames: int, native_fps: float) -> list[int]:
        raise NotImplementedError

    def prepare_frames(self, clip: ClipFrames) -> PreparedMedia:
        raise NotImplementedError

    def prepare_image(self, image: Image.Image) -> PreparedMedia:
        raise NotImplementedError
