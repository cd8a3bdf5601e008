"""When a request is done, and the text it returns.

A request stops at an end-of-sequence token (unless `ignore_eos`), one of its stop token ids, a stop
string, its `max_new_tokens`, or the model's context length. Its text is the decoded output, cut before
the first stop string.
"""

from __future__ import annotations

from batchvl.engine.request import Request

STOP_WINDOW_SLACK = 8  # tokens decoded beyond the longest stop string's length (see _ends_in_stop_string)


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def prepare(self, request: Request) -> None:
        """Give a request, as it is added, what `ended` asks of each of its new tokens: the tokens that end
        it (end-of-sequence unless `ignore_eos`, and its stop token ids) and the most tokens it may
        generate (its `max_new_tokens`, or what the model's context leaves after its prompt)."""
        params = request.sampling
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        request.stop_ids = frozenset(stops)
        request.output_limit = min(params.max_new_tokens, self.max_model_len - len(request.prompt_token_ids))

    def ended(self, requests: list[Request]) -> list[tuple[Request, str]]:
        """Each of the (prepared) requests whose newest token ends it, with why (`finish_reason`), in their
        order. The rules are asked only of a request whose token is one that ends it, whose output reached
        its limit, or that has stop strings, whose text must be looked at: at 1,024 decodes a step, asking
        every request cost half a millisecond of host work a step, and a step ends few of them."""
        ended = []
        for request in requests:
            output = request.output_token_ids
            if output[-1] in request.stop_ids or len(output) >= request.output_limit or request.sampling.stop:
                reason = self.finish_reason(request)
                if reason is not None:
                    ended.append((request, reason))
        return ended

    def finish_reason(self, request: Request) -> str | None:
        """Why the request ends ("stop" or "length"), None while it goes on; called after each new token."""
        params = request.sampling
        output = request.output_token_ids
        token = output[-1]
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self._ends_in_stop_string(request):
            return "stop"
        # (lengths as len(): asked of every request every step, where the properties' calls added up)
        if len(output) >= params.max_new_tokens:
            return "length"
        if len(request.prompt_token_ids) + len(output) >= self.max_model_len:
            return "length"
        return None

    def _ends_in_stop_string(self, request: Request) -> bool:
        """Whether the newest token completed a stop string. Only a window of the latest tokens is decoded,
        not the whole output every step: a stop string completed earlier would have ended the request
        then. The window holds a token per character of the longest stop string (a token decodes to at
        least one character but for special tokens and split characters), and slack for those."""
        window = max(len(stop) for stop in request.sampling.stop) + STOP_WINDOW_SLACK
        tail = self.tokenizer.decode(request.output_token_ids[-window:], skip_special_tokens=True)
        return any(stop and stop in tail for stop in request.sampling.stop)

    def text_of(self, request: Request) -> str:
        """The decoded output, cut before the first stop string it holds."""
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        found = [text.find(stop) for stop in request.sampling.stop if stop and stop in text]
        return text[: min(found)] if found else text
