"""A gallery of sampled inputs beside their outputs, as self-contained HTML (images are data URIs).

Shared by `batchvl report` and `Results.gallery()` in notebooks. The images are read again from the
job's input, by shard and sample index, through the same readers the job used.
"""

from __future__ import annotations

import base64
import html
import io
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field

import pyarrow as pa
from PIL import Image

from batchvl.config import JobConfig
from batchvl.errors import RowStatus, SampleError
from batchvl.inputs.fetch_ahead import media_ready
from batchvl.inputs.sources import job_source
from batchvl.inputs.types import MediaRef, Sample
from batchvl.preprocess.image import decode_image

THUMBNAIL_SIDE = 224


@dataclass
class GalleryOutput:
    prompt: str
    text: str | None
    status: RowStatus
    error_type: str | None
    error_message: str | None
    fields: dict | None = None  # a JSON-schema prompt's ok output, parsed: shown field by field


@dataclass
class GalleryItem:
    shard: str
    sample_index: int
    key: str
    thumbnails: list[str] = field(default_factory=list)  # data URIs
    media_notes: list[str] = field(default_factory=list)  # media that cannot be shown, and why
    outputs: list[GalleryOutput] = field(default_factory=list)


def pick_samples(table: pa.Table, n: int, seed: int) -> list[tuple[str, int]]:
    """`n` (shard, sample_index) pairs, a seeded random choice that prefers samples with an ok row."""
    shards, indices = table["shard"].to_pylist(), table["sample_index"].to_pylist()
    samples = list(dict.fromkeys(zip(shards, indices, strict=True)))
    with_ok = {
        (shard, index)
        for shard, index, status in zip(shards, indices, table["status"].to_pylist(), strict=True)
        if status == "ok"
    }
    rng = random.Random(seed)
    preferred = [s for s in samples if s in with_ok]
    rest = [s for s in samples if s not in with_ok]
    chosen = rng.sample(preferred, min(n, len(preferred)))
    chosen += rng.sample(rest, min(n - len(chosen), len(rest)))
    order = {sample: number for number, sample in enumerate(samples)}
    return sorted(chosen, key=order.__getitem__)


def gallery_items(cfg: JobConfig, table: pa.Table, n: int, seed: int = 0) -> list[GalleryItem]:
    """The chosen samples with their outputs (from `table`, which has a `shard` column) and thumbnails."""
    chosen = pick_samples(table, n, seed)
    items = {sample: GalleryItem(sample[0], sample[1], "") for sample in chosen}
    json_prompts = {prompt.name for prompt in cfg.prompts if prompt.json_schema is not None}
    for row in table.select(
        ["shard", "sample_index", "key", "prompt", "text", "status", "error_type", "error_message"]
    ).to_pylist():
        item = items.get((row["shard"], row["sample_index"]))
        if item is not None:
            item.key = row["key"]
            output = GalleryOutput(
                row["prompt"], row["text"], row["status"], row["error_type"], row["error_message"]
            )
            if output.status == "ok" and output.prompt in json_prompts:
                parsed = json.loads(output.text)
                output.fields = parsed if isinstance(parsed, dict) else None
            item.outputs.append(output)
    for sample in read_samples(cfg, list(items)):
        item = items[(sample.shard, sample.index)]
        if sample.error is not None:  # its media could not be read or downloaded: nothing to show
            item.media_notes.append(sample.error.message)
            continue
        for ref in sample.images:
            try:
                item.thumbnails.append(data_uri(thumbnail(ref, cfg.preprocess.max_image_pixels)))
            except SampleError as error:
                item.media_notes.append(error.message)
            except Exception as error:  # a gallery shows what it can: one odd image never ends the page
                item.media_notes.append(f"cannot show this image: {type(error).__name__}: {error}")
    return list(items.values())


def read_samples(cfg: JobConfig, wanted: list[tuple[str, int]]) -> list[Sample]:
    """The raw samples at (shard, sample_index), read with the job's own input reader."""
    by_shard: dict[str, set[int]] = defaultdict(set)
    for shard, index in wanted:
        by_shard[shard].add(index)
    source = job_source(cfg)
    samples = []
    for info in source.list_shards():
        indices = by_shard.get(info.shard)
        if not indices:
            continue
        for sample in source.iter_shard(info, indices.__contains__):
            if isinstance(sample, Sample) and sample.index in indices:
                samples.append(media_ready(sample))
    return samples


def thumbnail(ref: MediaRef, max_image_pixels: int) -> Image.Image:
    image = (
        first_video_frame(ref) if ref.kind == "video" else decode_image(ref.data, ref.path, max_image_pixels)
    )
    image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
    return image


def first_video_frame(ref: MediaRef) -> Image.Image:
    import av

    try:
        with av.open(io.BytesIO(ref.data) if ref.data is not None else ref.path) as container:
            for frame in container.decode(video=0):
                return frame.to_image()
    except (av.error.FFmpegError, OSError, IndexError) as exc:
        raise SampleError("video_decode_error", f"cannot decode video: {exc}") from exc
    raise SampleError("video_decode_error", "video has no decodable frame")


def data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


GALLERY_CSS = """
.bvl-gallery{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:12px}
.bvl-card{border:1px solid #ccd;border-radius:6px;padding:8px;background:#fff}
.bvl-card img{max-width:224px;max-height:224px;display:block;margin:0 auto 6px auto}
.bvl-key{font:12px monospace;color:#556}
.bvl-out{margin:4px 0;font-size:14px;overflow-wrap:anywhere}
.bvl-prompt{font-weight:600}
.bvl-error{color:#a00}
.bvl-note{color:#a60;font-size:12px}
.bvl-fields{display:grid;grid-template-columns:max-content 1fr;gap:0 8px;margin:2px 0 0 8px}
.bvl-fields dt{color:#555}
.bvl-fields dd{margin:0}
"""


def gallery_html(items: list[GalleryItem], with_style: bool = True) -> str:
    cards = []
    for item in items:
        images = "".join(
            f'<img class="bvl-thumb" src="{uri}" alt="{html.escape(item.key)} image {number}">'
            for number, uri in enumerate(item.thumbnails)
        )
        notes = "".join(f'<div class="bvl-note">{html.escape(note)}</div>' for note in item.media_notes)
        outputs = "".join(_output_html(output) for output in item.outputs)
        cards.append(
            f'<div class="bvl-card" data-shard="{html.escape(item.shard)}" data-sample="{item.sample_index}">'
            f'{images}{notes}<div class="bvl-key">{html.escape(item.shard)} · key {html.escape(item.key)}'
            "</div>"
            f"{outputs}</div>"
        )
    style = f"<style>{GALLERY_CSS}</style>" if with_style else ""
    return f'{style}<div class="bvl-gallery" id="gallery">{"".join(cards)}</div>'


def _output_html(output: GalleryOutput) -> str:
    prompt = f'<span class="bvl-prompt">{html.escape(output.prompt)}:</span> '
    if output.fields is not None:
        fields = "".join(
            f"<dt>{html.escape(name)}</dt><dd>{html.escape(_json_text(value), quote=False)}</dd>"
            for name, value in output.fields.items()
        )
        return f'<div class="bvl-out">{prompt}<dl class="bvl-fields">{fields}</dl></div>'
    if output.status == "ok":
        return f'<div class="bvl-out">{prompt}{html.escape(output.text or "")}</div>'
    message = f"{output.error_type}: {output.error_message}"
    return f'<div class="bvl-out bvl-error">{prompt}{html.escape(message)}</div>'


def _json_text(value) -> str:
    return json.dumps(value, ensure_ascii=False)
