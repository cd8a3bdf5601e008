"""What goes to an OpenAI-compatible server for one engine request, and what its answers become.

A request is a chat completion: the messages (media as URLs, usually data URLs) and the sampling. Labels
use the server's structured outputs: a JSON schema as the built-in engine's grammar (compact) or in
`response_format` (any whitespace), both keeping the written property order; vLLM's `structured_outputs`
for a regex or generated choices. A scored-choices prompt is one request per choice, the choice written
as the assistant's answer (followed by the end-of-sequence token) and `prompt_logprobs` asked for: the
server computes the teacher-forced log-probability of every prompt token, whose last ones are the
choice's, which is how the built-in engine scores it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.choice_scoring import ChoiceTokenizer
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.sampling.structured_output import OutputConstraint
from batchvl.errors import SampleError

TOKEN_ID_PREFIX = "token_id:"  # how vLLM writes a token with `return_tokens_as_token_ids`
VLLM_NO_LOGPROB = -9999.0  # what vLLM writes for the log-probability of a token it cannot sample

# What an answer may weigh: its envelope, then per token it may hold at most this many bytes per entry (its
# text JSON-escaped, and each log-probability candidate's token, bytes and value). A scored choice's answer
# holds every prompt token's candidates, of a prompt whose length the server alone knows.
ANSWER_ENVELOPE_BYTES = 64 * 1024
TOKEN_ENTRY_BYTES = 512
PROMPT_LOGPROBS_ANSWER_BYTES = 256 * 1024 * 1024


def answer_limit(body: dict) -> int:
    """The most bytes an answer to `body` can hold: a larger one is refused unread (a server that sends
    megabytes for a few tokens would otherwise fill the job's memory)."""
    if "prompt_logprobs" in body:
        return PROMPT_LOGPROBS_ANSWER_BYTES
    entries = 1 + (1 + (body.get("top_logprobs") or 0) if body.get("logprobs") else 0)
    return ANSWER_ENVELOPE_BYTES + body["max_tokens"] * entries * TOKEN_ENTRY_BYTES


def chat_body(model: str, request: EngineRequest, token_ids: bool) -> dict:
    """The chat-completion body of a generating request; `token_ids`: ask for log-probability tokens as
    ids (vLLM's `return_tokens_as_token_ids`), which the rows' `token_id` needs."""
    body = {"model": model, "messages": list(request.messages)}
    body.update(sampling_fields(request.sampling))
    if request.sampling.wants_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = request.sampling.top_logprobs
        if token_ids:
            body["return_tokens_as_token_ids"] = True
    if request.constraint is not None:
        body.update(constraint_fields(request.constraint))
    return body


def sampling_fields(params: SamplingParams) -> dict:
    """The sampling settings as chat-completion fields (top_k, stop_token_ids and min_tokens are vLLM's and
    SGLang's extensions)."""
    fields = {
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.is_greedy else params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
    }
    if params.top_k:
        fields["top_k"] = params.top_k
    if params.stop:
        fields["stop"] = list(params.stop)
    if params.stop_token_ids:
        fields["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        fields["min_tokens"] = params.max_new_tokens  # no end-of-sequence before the limit
    return fields


def constraint_fields(constraint: OutputConstraint) -> dict:
    if constraint.kind == "json_schema":
        if constraint.any_whitespace:
            schema = json.loads(constraint.spec)  # a dict keeps the order the properties were written in
            return {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "output", "schema": schema},
                }
            }
        # Compact JSON: vLLM sets whitespace for the whole server, not per request, so the request carries
        # the grammar the built-in engine compiles from the schema (its properties in the written order)
        return {"structured_outputs": {"grammar": grammar_text(constraint)}}
    if constraint.kind == "regex":
        return {"structured_outputs": {"regex": constraint.spec}}
    return {"structured_outputs": {"choice": json.loads(constraint.spec)}}


def choice_answer(choice: str, choice_tokens: ChoiceTokenizer) -> str:
    """The assistant answer that scores a choice: its text, then the end-of-sequence token's text (which
    the server's tokenizer reads back as that token), so that it ends as the engine's scored tokens do."""
    return choice + choice_tokens.tokenizer.convert_ids_to_tokens(choice_tokens.eos_token_id)


def choice_body(model: str, request: EngineRequest, answer: str) -> dict:
    """The body that scores one choice: the conversation with `answer` (the choice and the end-of-sequence
    token) as the assistant's final message, continued rather than closed, and one generated token."""
    messages = [*request.messages, {"role": "assistant", "content": answer}]
    return {
        "model": model,
        "messages": messages,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": request.sampling.top_logprobs,
    }


@functools.lru_cache(maxsize=64)
def grammar_text(constraint: OutputConstraint) -> str:
    """The constraint's grammar as EBNF, compiled once per job for all its requests."""
    return str(constraint.grammar())


@dataclass
class ScoredTokens:
    """A choice's teacher-forced log-probabilities: per token, its own and the most likely there."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def scored_tokens(response: dict, token_ids: list[int], top_logprobs: int) -> ScoredTokens:
    """The log-probabilities of the last `len(token_ids)` prompt tokens from a choice's response, checked
    to be those tokens (a server that tokenized the choice otherwise scored something else)."""
    entries = response.get("prompt_logprobs") or []
    tail = entries[len(entries) - len(token_ids) :] if len(entries) >= len(token_ids) else []
    if len(tail) != len(token_ids) or any(entry is None for entry in tail):
        raise SampleError(
            "server_error", "the server's answer has no log-probabilities for the choice's tokens"
        )
    logprobs, top = [], []
    for entry, token in zip(tail, token_ids, strict=True):
        own = entry.get(str(token))
        if own is None:
            raise SampleError(
                "server_error",
                f"the server tokenized the choice differently (expected token {token} at its position, got "
                f"{sorted(entry)}); use the tokenizer the server uses at model.path",
            )
        logprobs.append(logprob_of(own))
        ranked = sorted(((int(t), v) for t, v in entry.items()), key=lambda item: item[1]["rank"])
        top.append([(t, logprob_of(v)) for t, v in ranked if v["rank"] <= top_logprobs][:top_logprobs])
    return ScoredTokens(logprobs, top)


def logprob_of(entry: dict) -> float:
    """An entry's log-probability as the engine writes it: vLLM writes a token of probability 0 (one a
    grammar masks) as VLLM_NO_LOGPROB, JSON having no -inf; the engine writes -inf."""
    value = float(entry["logprob"])
    return float("-inf") if value <= VLLM_NO_LOGPROB else value


def token_of(entry: dict) -> tuple[int | None, str]:
    """(token id, text) of a log-probability entry; the id is known where tokens were asked for as ids."""
    token = entry["token"]
    if token.startswith(TOKEN_ID_PREFIX):
        return int(token[len(TOKEN_ID_PREFIX) :]), ""
    return None, token
