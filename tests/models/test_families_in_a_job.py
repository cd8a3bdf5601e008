"""Each family through a whole job: image rows carry the text `generate` writes, a video row is captioned
by the families that take video and is an `unsupported_media` error row for the others."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import job_config_from_dict
from batchvl.inputs.types import MediaRef
from batchvl.pipeline.runner import run_job
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import NEW_FAMILIES, random_image, video_bytes
from tests.engine.reference import generate_reference, inputs_for

PROMPT = "Describe this image."
MAX_NEW_TOKENS = 6


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_job_writes_the_reference_texts(tmp_path, family_models, family):
    path, loaded = family_models(family)
    data = tmp_path / "data"
    data.mkdir()
    images = {f"img{i}.png": random_image(50 + 20 * i, 90 - 10 * i, 40 + i) for i in range(3)}
    for name, image in images.items():
        image.save(data / name)
    (data / "clip.mp4").write_bytes(video_bytes(12, 10, 56, 84))
    names = [*images, "img0.png", "clip.mp4"]
    pq.write_table(
        pa.table({"key": [f"k{i}" for i in range(len(names))], "image": names}), data / "a.parquet"
    )
    cfg = job_config_from_dict(
        {
            "model": {"path": str(path), "dtype": "float32"},
            "input": {"paths": [str(data / "*.parquet")], "key_column": "key"},
            "prompts": [{"name": "caption", "text": PROMPT}],
            "sampling": {"max_new_tokens": MAX_NEW_TOKENS},
            "engine": {"max_num_batched_tokens": 32, "block_size": 4},
            "preprocess": {"workers": 1},
            "output": {"dir": str(tmp_path / "out")},
        },
        tmp_path,
    )
    summary = run_job(cfg, loaded=loaded, show_progress=False)
    rows = {r["key"]: r for r in pq.read_table(tmp_path / "out" / "a.parquet").to_pylist()}
    assert len(rows) == len(names)

    processor = loaded.processor
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for i, name in enumerate(names[:-1]):
        key = f"k{i}"
        inputs = processor(text=[rendered], images=[images[name]], return_tensors="pt")
        generated = reference.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        expected = processor.tokenizer.decode(
            generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        )
        assert rows[key]["status"] == "ok" and rows[key]["text"] == expected, key
    assert summary.stats["images_encoded"] == 3 + loaded.family.video  # the repeated image once

    clip = rows[f"k{len(names) - 1}"]
    if loaded.family.video:
        # The video processor needs torchvision: the reference gets batchvl's own video tensors, whose
        # equality with the model's processing the video parity tests check.
        prepare_media = loaded.family.media_preparer(processor, reference.config, cfg.preprocess)
        media = [prepare_media(MediaRef(None, str(data / "clip.mp4"), "video"))]
        renderer = PromptRenderer(processor)
        ids = renderer.token_ids(renderer.render(PROMPT, ["video"]), media)
        expected = generate_reference(reference, inputs_for(reference, ids, media), MAX_NEW_TOKENS)
        assert clip["status"] == "ok"
        assert clip["text"] == processor.tokenizer.decode(expected.tokens, skip_special_tokens=True)
        assert clip["num_output_tokens"] == len(expected.tokens)
    else:
        assert clip["status"] == "error" and clip["error_type"] == "unsupported_media"
        assert "images only" in clip["error_message"]
