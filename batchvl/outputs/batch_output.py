"""`output.format: openai_batch`: each shard's rows also as a JSONL file in the OpenAI Batch API's output
shape, `<shard>.output.jsonl` beside the shard's Parquet file.

A line per row, in input order: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body":
<a chat.completion>}, "error": null}` for an ok row, `{"id", "custom_id", "response": null, "error":
{"code": <error_type>, "message": ...}}` otherwise. A follow-up that was skipped ran no request: like the
API's requests that never ran (`batch_expired`), it has `"response": null` and `"error": {"code":
"skipped", "message": <why, as its row's error_message says: the `when` it did not meet, or the skipped
prompt it uses>}`. `custom_id` is
the sample's key (with `:<prompt>` when the job has several prompts); `id` is unique in the job (it hashes
the shard and the row's place in it); `created` is when the file was written. The file is written whole
after the Parquet file and before the shard's marker, so a committed shard has both and a rerun redoes a
shard that has only some of them; `retry-failed` rewrites it with the merged rows.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import xxhash

from batchvl.outputs.writers import output_path
from batchvl.storage.output_dir import OutputDir

COLUMNS = [
    "sample_index", "key", "prompt", "status", "text", "error_type", "error_message", "finish_reason",
    "num_prompt_tokens", "num_output_tokens",
]  # fmt: skip


def batch_output_path(out: OutputDir, shard: str) -> str:
    return output_path(out, shard).removesuffix(".parquet") + ".output.jsonl"


def write_batch_output(out: OutputDir, shard: str, table: pa.Table, model: str, created: int) -> str:
    path = batch_output_path(out, shard)
    several_prompts = len(set(table["prompt"].to_pylist())) > 1
    lines = [
        batch_line(row, shard, model, created, several_prompts) for row in table.select(COLUMNS).to_pylist()
    ]
    out.write_text(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return path


def batch_line(row: dict, shard: str, model: str, created: int, several_prompts: bool) -> dict:
    custom_id = f"{row['key']}:{row['prompt']}" if several_prompts else row["key"]
    # From the row itself, so a row that a retry leaves alone keeps its id when the file is rewritten; its
    # shard and place in it, so rows alike (the same error in two files, a repeated key) have ids apart.
    digest = xxhash.xxh64_hexdigest(
        f"{model}\0{shard}\0{row['sample_index']}\0{custom_id}\0{row['status']}\0{row['text']}".encode()
    )
    line = {"id": f"batch_req_{digest}", "custom_id": custom_id, "response": None, "error": None}
    if row["status"] != "ok":
        # A skipped row's message says why it did not run (rows committed before it did say "not run").
        message = row["error_message"] or ("not run" if row["status"] == "skipped" else "")
        line["error"] = {"code": row["error_type"] or row["status"], "message": message}
        return line
    prompt_tokens, completion_tokens = row["num_prompt_tokens"], row["num_output_tokens"]
    line["response"] = {
        "status_code": 200,
        "request_id": digest,
        "body": {
            "id": f"chatcmpl-{digest}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": row["text"]},
                    "logprobs": None,
                    "finish_reason": "length" if row["finish_reason"] == "length" else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        },
    }
    return line


def model_name(model_path: str) -> str:
    return os.path.basename(os.path.normpath(model_path))
