"""`openai_batch` input: JSONL files of chat-completion requests, as the OpenAI Batch API takes them.

Each non-empty line is one request, its key the line's `custom_id`:
`{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}`.
Messages (system, user, assistant turns) keep their order and are rendered with the model's chat template;
`image_url` parts become the sample's media in order (a `data:` URI is decoded here, an http(s) URL is
downloaded like a table's URL cells). `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`,
`stop` and `seed` override the job's sampling for that request; `response_format` `json_schema` or
`json_object` constrains the output. A line that cannot be run as asked is an error row: `bad_request`
(not JSON, no custom_id, no messages) or `unsupported_request` (another endpoint, tools, n > 1, audio,
log-probabilities).

Lines end at `\n` (or `\r\n`): a bare `\r` is JSON whitespace inside a line; a UTF-8 BOM at the start is
dropped. Each custom_id names one request: a line that repeats an earlier line's custom_id is a `bad_request`
error row naming that line (the first one runs), as its output line could not be told apart.

The file is read twice, line by line: once for the hashes of its custom_ids (8 bytes a line, to find the
repeated ones), then for its requests; a file of 10,000 requests takes the memory of the ones in flight.
"""

from __future__ import annotations

import io
import json
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import xxhash

from batchvl.config import InputConfig
from batchvl.errors import SampleError
from batchvl.inputs.data_urls import data_url_bytes, is_data_url
from batchvl.inputs.download import is_url
from batchvl.inputs.paths import stream_shards
from batchvl.inputs.types import ChatRequest, MediaRef, Sample, ShardEnd, ShardInfo
from batchvl.storage.remote import open_input

SUFFIXES = (".jsonl",)
ENDPOINT = "/v1/chat/completions"
ROLES = ("system", "user", "assistant", "developer")
# Body keys that ask for something batchvl does not do; any other unknown key (model, user, metadata,
# store, ...) does not change the output and is ignored.
UNSUPPORTED = {
    "tools": "tool calls",
    "functions": "function calls",
    "tool_choice": "tool calls",
    "audio": "audio output",
    "modalities": "output modalities",
    "prediction": "predicted outputs",
    # the output line's `logprobs` is null: a line asking for them would silently get none
    "logprobs": "log-probabilities in the output (sampling.logprobs gives them as result columns)",
    "top_logprobs": "log-probabilities in the output (sampling.top_logprobs gives them as result columns)",
}


class OpenAIBatchSource:
    def __init__(self, cfg: InputConfig):
        self.paths = cfg.paths
        self.storage_options = cfg.storage_options

    def list_shards(self) -> list[ShardInfo]:
        return stream_shards(self.paths, SUFFIXES, ".jsonl files", self.storage_options)

    def iter_shard(self, shard: ShardInfo, keep: Callable[[int], bool]) -> Iterator[Sample | ShardEnd]:
        repeated = self._repeated_ids(shard)
        first_lines: dict[str, int] = {}  # a repeated custom_id: the line that has it first
        index = 0
        for number, line in self._lines(shard):
            first = None
            if repeated:  # every line's id, kept or not: a retry that reads some lines must still see them
                custom_id = _custom_id(line)
                if custom_id is not None and _hash(custom_id) in repeated:
                    first = first_lines.setdefault(custom_id, number)
            if keep(index):
                sample = parse_line(shard.shard, index, number, line)
                if first is not None and first != number:
                    sample.error = SampleError(
                        "bad_request",
                        f"custom_id {sample.key!r} is already line {first}'s: each request needs a "
                        f"custom_id of its own (line {first} runs, this line does not)",
                    )
                yield sample
            index += 1
        yield ShardEnd(shard.shard, index)

    def _lines(self, shard: ShardInfo) -> Iterator[tuple[int, str]]:
        """(line number, line) of each non-blank line; only `\n` ends a line, as in JSONL."""
        with (
            open_input(shard.path, self.storage_options) as binary,
            io.TextIOWrapper(binary, encoding="utf-8-sig", errors="replace", newline="\n") as lines,
        ):
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield number, line

    def _repeated_ids(self, shard: ShardInfo) -> set[int]:
        """The hashes of the custom_ids that more than one line has (sorted in place: no copy of the ids)."""
        ids = (_custom_id(line) for _, line in self._lines(shard))
        hashes = array("Q", (_hash(custom_id) for custom_id in ids if custom_id is not None))
        if len(hashes) < 2:
            return set()
        ordered = np.frombuffer(hashes, dtype=np.uint64)
        ordered.sort()
        return set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())


def _custom_id(line: str) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    custom_id = record.get("custom_id") if isinstance(record, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def _hash(custom_id: str) -> int:
    return xxhash.xxh64_intdigest(custom_id.encode("utf-8", "surrogatepass"))  # JSON allows lone surrogates


def parse_line(shard: str, index: int, number: int, line: str) -> Sample:
    """One line -> a sample holding its request, or an error sample keyed by its custom_id (or its line
    number when it has none) saying what is wrong with it."""
    sample = Sample(shard, index, f"line-{number}", [])
    try:
        record = json.loads(line)
    except ValueError as exc:
        sample.error = SampleError("bad_request", f"line {number} is not JSON: {exc}")
        return sample
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("custom_id"), str)
        or not record["custom_id"]
    ):
        sample.error = SampleError("bad_request", f"line {number} has no custom_id (a non-empty string)")
        return sample
    sample.key = record["custom_id"]
    try:
        sample.chat, sample.images = chat_request(record)
    except SampleError as exc:
        sample.error = exc
    return sample


def chat_request(record: dict) -> tuple[ChatRequest, list[MediaRef]]:
    url = record.get("url", ENDPOINT)
    if url != ENDPOINT:
        raise SampleError("unsupported_request", f"url {url!r}: only {ENDPOINT} requests are run")
    body = record.get("body")
    if not isinstance(body, dict):
        raise SampleError("bad_request", "the request has no body object")
    for key, what in UNSUPPORTED.items():
        if body.get(key):
            raise SampleError("unsupported_request", f"body.{key}: {what} are not supported")
    if body.get("n", 1) != 1:
        raise SampleError("unsupported_request", f"body.n = {body['n']}: one choice per request is supported")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise SampleError("bad_request", "body.messages must be a non-empty list")
    media: list[MediaRef] = []
    messages = tuple(_message(m, i, media) for i, m in enumerate(raw_messages))
    chat = ChatRequest(
        messages=messages,
        max_tokens=_positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens"),
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1),
        stop=_stop(body.get("stop")),
        seed=body["seed"] if isinstance(body.get("seed"), int) else None,
        json_schema=_schema(body.get("response_format")),
    )
    return chat, media


def _message(message: Any, position: int, media: list[MediaRef]) -> dict:
    where = f"body.messages[{position}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise SampleError("bad_request", f"{where} needs a role ({', '.join(ROLES)})")
    role = "system" if message["role"] == "developer" else message["role"]
    content = message.get("content")
    if isinstance(content, str):
        return {"role": role, "content": [{"type": "text", "text": content}]}
    if not isinstance(content, list):
        raise SampleError("bad_request", f"{where}.content must be a string or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            media.append(_image(part.get("image_url"), f"{where}.content[{j}]"))
            parts.append({"type": "image"})
        else:
            raise SampleError(
                "unsupported_request", f"{where}.content[{j}]: parts of type {kind!r} are not supported"
            )
    return {"role": role, "content": parts}


def _image(spec: Any, where: str) -> MediaRef:
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise SampleError("bad_request", f"{where}: image_url needs a url")
    if is_data_url(url):
        try:
            return MediaRef(data_url_bytes(url), None)
        except ValueError as exc:
            raise SampleError("bad_request", f"{where}: {exc}") from None
    if is_url(url):
        return MediaRef(None, None, "image", url)
    raise SampleError(
        "unsupported_request",
        f"{where}: image_url must be an http(s), data: or object-store (s3://, gs://) URL, got {url[:60]!r}",
    )


def _positive_int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SampleError("bad_request", f"body.{key} must be a positive integer, got {value!r}")
    return value


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise SampleError("bad_request", f"body.{key} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _stop(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise SampleError("bad_request", f"body.stop must be a string or a list of strings, got {value!r}")


def _schema(response_format: Any) -> dict | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise SampleError(
                "bad_request", "response_format json_schema needs json_schema.schema (an object)"
            )
        return schema
    raise SampleError("unsupported_request", f"response_format type {kind!r} is not supported")
