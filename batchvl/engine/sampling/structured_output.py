"""Constrained decoding: a request may carry a constraint its output must follow (a JSON schema, a regular
expression, or a list of choices), enforced with xgrammar as vLLM and SGLang do.

Each distinct constraint is compiled once per engine (keyed by its text: a schema's property order is kept)
against the model's tokenizer; each constrained request holds its own matcher. Every step, the logits
rows of constrained requests that sample get their token bitmask (masked tokens to -inf) before sampling,
and each matcher then accepts its request's new token; unconstrained rows are not touched. A matcher that
accepted an end-of-sequence token ends its request; a request that ends where its grammar could not (a
token limit, a stop string) is `incomplete`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Literal

import torch

from batchvl.errors import first_line
from batchvl.layers.attention import uploaded
from batchvl.utils.int_tensors import int64_tensor
from batchvl.utils.page_locked import host_empty

# JSON without whitespace between tokens: with free whitespace a weak model can fill its whole budget with
# spaces and newlines, and every byte of layout is a token generated for nothing.
COMPACT_SEPARATORS = (",", ":")


@dataclass(frozen=True)
class OutputConstraint:
    """What an output must match, as plain data (a request carries it; the engine compiles it)."""

    kind: Literal["json_schema", "regex", "choices"]
    # The schema as compact JSON in the order it was written (its property order is the order the model
    # writes the properties in), the regular expression, or the choices as a JSON list.
    spec: str
    any_whitespace: bool = False  # json_schema: allow free whitespace between JSON tokens

    @classmethod
    def json_schema(cls, schema: dict, any_whitespace: bool = False) -> OutputConstraint:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), any_whitespace)

    @classmethod
    def choices(cls, choices: list[str]) -> OutputConstraint:
        return cls("choices", json.dumps(list(choices), ensure_ascii=False))

    def grammar(self):
        """The xgrammar `Grammar` (tokenizer-independent). Raises ValueError with xgrammar's reason when
        the schema or regex cannot be converted."""
        import xgrammar as xgr

        try:
            if self.kind == "json_schema":
                separators = None if self.any_whitespace else COMPACT_SEPARATORS
                return xgr.Grammar.from_json_schema(
                    self.spec, any_whitespace=self.any_whitespace, separators=separators
                )
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.spec)
            alternatives = " | ".join(
                json.dumps(choice, ensure_ascii=False) for choice in json.loads(self.spec)
            )
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        except RuntimeError as exc:
            raise ValueError(_xgrammar_reason(exc)) from None


def _xgrammar_reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:83: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first_line(exc))


class GrammarMatchers:
    """The engine's constrained decoding: compiled grammars by constraint, a fresh matcher for each
    constrained request (the request holds it), and the step's bitmask. A request without a constraint
    has the matcher None, which every method accepts: it is never masked, always complete."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's vocabulary
        self.stop_token_ids = stop_token_ids
        self._compiler = None  # built on the first constrained request: reading the vocabulary takes a while
        self._compiled: dict[OutputConstraint, object] = {}
        self._bitmask: torch.Tensor | None = None
        self._filler = None  # xgrammar's BatchGrammarMatcher, made on the first constrained step
        self.num_compiled = 0
        self.seconds = 0.0  # compiling, masking and advancing: what constraints add to the steps

    def matcher(self, constraint: OutputConstraint):
        """A new matcher for one request's output, its grammar compiled on the constraint's first use."""
        import xgrammar as xgr

        started = time.perf_counter()
        compiled = self._compiled.get(constraint)
        if compiled is None:
            compiled = self._compiled[constraint] = self._get_compiler().compile_grammar(constraint.grammar())
            self.num_compiled += 1
        matcher = xgr.GrammarMatcher(compiled)
        self.seconds += time.perf_counter() - started
        return matcher

    def _get_compiler(self):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def mask(self, logits: torch.Tensor, matchers: list) -> None:
        """Mask, in place, each row of `logits` whose matcher (row i is matchers[i]) is not None to the
        tokens its grammar allows next. The host never waits for the device here: towards a GPU the bitmask
        goes from page-locked memory without blocking, so that an overlapped step fills it while the
        forward runs (a pageable copy would wait for that forward)."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return  # no constrained request: a free-text step pays nothing
        import xgrammar as xgr

        started = time.perf_counter()
        bitmask = self._step_bitmask(len(matchers), logits.device)
        # One call for the step's rows: at 256 rows of a five-field schema it took half the time of a call
        # per row (the Python around each call). One thread: on 2 cores a second one made it slower at 1,
        # 16 and 256 rows, and on a GPU the fill runs beside the forward where overlapped.
        self._batch_filler().batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, rows)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        indices = rows
        if logits.device.type != "cpu":  # the rows too from page-locked memory (xgrammar's copy is pageable)
            (indices,) = uploaded([int64_tensor(rows)], logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)
        self.seconds += time.perf_counter() - started

    def _batch_filler(self):
        import xgrammar as xgr

        if self._filler is None:
            self._filler = xgr.BatchGrammarMatcher(max_threads=1)
        return self._filler

    def _step_bitmask(self, rows: int, device: torch.device) -> torch.Tensor:
        """A step's host bitmask: towards a GPU a fresh one from torch's caching host allocator (page-locked;
        a block comes back only once the copies recorded on it are done, so a later step never refills a
        bitmask still being sent); on the CPU the one kept for the engine, applied before the next fill."""
        if device.type == "cpu":
            return self._bitmask_rows(rows)
        import xgrammar as xgr

        shape = xgr.get_bitmask_shape(rows, self.vocab_size)
        return host_empty(shape, torch.int32, device)

    def accept(self, matcher, token: int) -> None:
        if matcher is not None and not matcher.is_terminated():
            started = time.perf_counter()
            matcher.accept_token(token)
            self.seconds += time.perf_counter() - started

    @staticmethod
    def is_terminated(matcher) -> bool:
        """The grammar accepted an end-of-sequence token: nothing more may follow."""
        return matcher is not None and matcher.is_terminated()

    def is_complete(self, matcher) -> bool:
        """The output so far is a whole match: its grammar ended, or would accept an end-of-sequence token
        now (an output cut by its token limit just after its last character is complete)."""
        if matcher is None or matcher.is_terminated():
            return True
        bitmask = self._bitmask_rows(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0]
        return any(int(words[token // 32]) >> (token % 32) & 1 for token in self.stop_token_ids)

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._bitmask
