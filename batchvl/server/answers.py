"""What a server's HTTP 200 answer must be before any of it becomes a row: a chat completion of the served
model, whose fields have their types (checked against a JSON schema), whose text is valid Unicode and no
longer than the request's `max_tokens` can be, that ended by a stop or its token limit. Anything else is
that request's `server_error` row naming what was wrong: one odd answer never stops the job.
"""

from __future__ import annotations

from dataclasses import dataclass

import jsonschema
from jsonschema.exceptions import best_match

from batchvl.errors import SampleError

FINISHED = ("stop", "length")  # an answer that ended otherwise (vLLM's `abort`, none) is partial
MAX_TOKEN_BYTES = 256  # the most UTF-8 bytes one token's text can decode to, with room to spare

_COUNT = {"type": "integer", "minimum": 0}
_NUMBER = {"type": "number"}
_TEXT = {"type": "string"}
_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {"token": _TEXT, "logprob": _NUMBER},
}
_CONTENT_PART = {"type": "object", "required": ["type"], "properties": {"type": _TEXT, "text": _TEXT}}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens"],
    "properties": {"prompt_tokens": _COUNT, "completion_tokens": _COUNT},
}
_CHOICE = {
    "type": "object",
    "required": ["message", "finish_reason"],
    "properties": {
        "message": {
            "type": "object",
            "properties": {
                "content": {"type": ["string", "array", "null"], "items": _CONTENT_PART},
                "reasoning_content": {"type": ["string", "null"]},
            },
        },
        "finish_reason": {"type": ["string", "null"]},
        "logprobs": {
            "type": ["object", "null"],
            "properties": {
                "content": {
                    "type": ["array", "null"],
                    "items": {
                        **_LOGPROB,
                        "properties": {
                            **_LOGPROB["properties"],
                            "top_logprobs": {"type": "array", "items": _LOGPROB},
                        },
                    },
                }
            },
        },
    },
}
# A scored choice's answer: per prompt token (null for the first), its candidates by token id
_PROMPT_LOGPROBS = {
    "type": ["array", "null"],
    "items": {
        "type": ["object", "null"],
        "additionalProperties": {
            "type": "object",
            "required": ["logprob", "rank"],
            "properties": {"logprob": _NUMBER, "rank": _COUNT},
        },
    },
}
CHAT_COMPLETION = jsonschema.Draft202012Validator(
    {
        "type": "object",
        "required": ["choices", "usage"],
        "properties": {
            "model": _TEXT,
            "choices": {"type": "array", "minItems": 1, "items": _CHOICE},
            "usage": _USAGE,
            "prompt_logprobs": _PROMPT_LOGPROBS,
        },
    }
)


@dataclass
class Generated:
    """A generating request's answer, checked."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] | None  # per output token: token, logprob, top_logprobs (where asked for)


def checked(answer: dict, model: str) -> dict:
    """`answer`, once it is a chat completion of `model` (the fields batchvl reads, of their types)."""
    error = best_match(CHAT_COMPLETION.iter_errors(answer))
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "the answer"
        raise _wrong(f"{where}: {error.message[:200]}")
    if answer.get("model", model) != model:
        raise _wrong(f"it names the model {answer['model']!r}, not {model!r}, which the job's rows are of")
    return answer


def generated(answer: dict, model: str, max_tokens: int, wants_logprobs: bool) -> Generated:
    """The text, end and counts of a generating request's answer, or its `server_error`."""
    choice = checked(answer, model)["choices"][0]
    message, usage = choice["message"], answer["usage"]
    text = _text(message)
    if choice["finish_reason"] not in FINISHED:
        raise _wrong(
            f"it ended with finish_reason {choice['finish_reason']!r}, not 'stop' or 'length': its text is "
            "partial (vLLM's 'abort': the server cancelled the request)"
        )
    if usage["completion_tokens"] > max_tokens or len(text.encode()) > max_tokens * MAX_TOKEN_BYTES:
        raise _wrong(
            f"its text ({usage['completion_tokens']} tokens, {len(text)} characters) is longer than "
            f"max_tokens={max_tokens} can be"
        )
    logprobs = (choice.get("logprobs") or {}).get("content")
    if wants_logprobs:
        if logprobs is None:
            raise _wrong("it has no log-probabilities, which the request asked for")
        for entry in logprobs:
            for token in [entry, *entry.get("top_logprobs", [])]:
                _unicode(token["token"], "a log-probability's token")
    return Generated(
        text, choice["finish_reason"], usage["prompt_tokens"], usage["completion_tokens"], logprobs
    )


def _text(message: dict) -> str:
    """The message's text: its content, or the text parts of a content given as parts (OpenAI's form)."""
    content = message.get("content")
    if content is None:
        reasoning = message.get("reasoning_content")
        if reasoning:
            raise _wrong(
                f"its content is null and its reasoning_content holds {len(reasoning)} characters: the "
                "server's reasoning parser took the answer; start the server without --reasoning-parser"
            )
        raise _wrong("its content is null")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if part["type"] == "text")
    return _unicode(content, "its text")


def _unicode(text: str, what: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise _wrong(f"{what} is not valid Unicode (a lone surrogate at character {exc.start})") from exc
    return text


def _wrong(why: str) -> SampleError:
    return SampleError("server_error", f"the server's answer cannot be used: {why}")
