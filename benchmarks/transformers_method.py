"""The throughput benchmark's transformers methods: a loop of `generate` one request at a time (a) and on
left-padded batches of 8 (b), the baselines users have, run in the benchmark's child process."""

from __future__ import annotations

import io
import time
from pathlib import Path

import torch
from processes import since_process_start
from throughput_workload import PROMPTS, error_text, requests_of


def hf_model(model_dir: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import batchvl.models.processor  # noqa: F401  registers the tiny model's image-only processor class

    processor = AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return processor, model


def rendered_prompt(processor, text: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def run_transformers(root: Path, model_dir: str, dtype: torch.dtype, batch: int, device: str) -> dict:
    """Every request ends as one row: ok, or error with the exception that stopped it (an image that does
    not decode fails its own requests; a failing processor or generate call fails its whole batch). On a GPU
    the workload runs a second time in the process: its warm rate, as batchvl's (a GPU's first calls load
    and pick kernels for seconds)."""
    from batchvl.engine.device.sync import synchronize  # imported late: see processes.PEER_ENV

    processor, model = hf_model(model_dir, dtype, device)
    texts = {name: rendered_prompt(processor, text) for name, text in PROMPTS.items()}
    requests = requests_of(root)
    start = time.perf_counter()
    result = transformers_pass(processor, model, texts, requests, dtype, batch, device)
    synchronize(torch.device(device))
    result["wall_s"] = time.perf_counter() - start
    if device != "cpu":
        start = time.perf_counter()
        warm = transformers_pass(processor, model, texts, requests, dtype, batch, device)
        synchronize(torch.device(device))
        if warm["rows"] != result["rows"]:
            raise SystemExit(f"the transformers method's warm pass wrote other rows: {warm['rows'][:3]}")
        result["warm_wall_s"] = time.perf_counter() - start
    return result


def transformers_pass(processor, model, texts, requests, dtype, batch: int, device: str) -> dict:
    """One pass of `generate` over the requests, `batch` at a time."""
    from PIL import Image

    rows = []  # [key, prompt, status, error message]
    output_tokens = 0
    startup = None
    with torch.inference_mode():
        for first in range(0, len(requests), batch):
            group, images = [], []
            for key, data, name, tokens in requests[first : first + batch]:
                try:
                    images.append(Image.open(io.BytesIO(data)).convert("RGB"))
                    group.append((key, name, tokens))
                except Exception as error:
                    rows.append([key, name, "error", error_text(error)])
            if not group:
                continue
            longest = max(tokens for _, _, tokens in group)
            try:
                inputs = processor(
                    text=[texts[name] for _, name, _ in group],
                    images=[[image] for image in images],  # each prompt's own (SmolVLM's asks it so)
                    return_tensors="pt",
                    padding=True,
                )
                inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
                inputs = inputs.to(device)
                # EOS ignored: every sequence runs to the batch's longest budget; each keeps its own budget.
                out = model.generate(
                    **inputs, max_new_tokens=longest, min_new_tokens=longest, do_sample=False
                )
                generated = out.shape[1] - inputs["input_ids"].shape[1]
                if generated != longest:
                    raise RuntimeError(f"generate returned {generated} new tokens, asked for {longest}")
            except Exception as error:
                rows.extend([key, name, "error", error_text(error)] for key, name, _ in group)
                continue
            rows.extend([key, name, "ok", None] for key, name, _ in group)
            output_tokens += sum(tokens for _, _, tokens in group)
            startup = startup or since_process_start()
    return {"startup_s": startup, "output_tokens": output_tokens, "rows": rows}
