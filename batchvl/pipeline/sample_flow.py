"""A sample's way through its prompts: which run now, which wait for an earlier prompt's output, and the
requests, skipped rows and dependency errors that outputs lead to.

A prompt that uses no other prompt's output was rendered in a preprocessing worker and runs as soon as
its sample arrives. A follow-up (see `prompt_graph.py`) waits, with its sample held here, until every
prompt it uses has its row; then it is rendered here with those outputs and goes to the engine (its
images are the sample's, so their embeddings are usually still in the encoder cache, and a continued
conversation starts with the earlier prompt's whole prompt, a prefix-cache hit), or it gets its row at
once: `skipped` where its `when` does not match or a prompt it uses was skipped, a `dependency_failed`
error where a prompt it uses failed. A sample is done when each of its selected prompts has its row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchvl.config import JobConfig, SamplingConfig
from batchvl.engine.request import EngineRequest
from batchvl.errors import SampleError
from batchvl.outputs.writers import ResultRow
from batchvl.pipeline.constraints import check_request_schema
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.rows import RowTag, error_row, max_new_tokens_of, prompt_request, skipped_row
from batchvl.preprocess.prompts import fill_template, template_values
from batchvl.preprocess.sample import PreparedSample, Prompt, PromptBuilder


@dataclass
class Progress:
    """What a step of a sample's flow produced: requests for the engine, rows, and whether the sample is
    now done (each of its selected prompts has its row)."""

    shard: str
    requests: list[EngineRequest] = field(default_factory=list)
    rows: list[ResultRow] = field(default_factory=list)
    sample_done: bool = False


@dataclass
class _SampleState:
    sample: PreparedSample
    priority: int
    max_new_tokens: list[int | SampleError]  # per prompt: its token limit on this sample, or why it has none
    waiting: set[int]  # selected follow-ups not yet rendered
    in_engine: int = 0
    rows: dict[int, ResultRow] = field(default_factory=dict)  # prompt index -> its row


class SampleFlow:
    def __init__(self, cfg: JobConfig, graph: PromptGraph, builder: PromptBuilder):
        self.cfg = cfg
        self.graph = graph
        self.builder = builder
        self._samples: dict[tuple[str, int], _SampleState] = {}

    def sample_of(self, tag: RowTag) -> PreparedSample:
        return self._samples[(tag.shard, tag.sample_index)].sample

    def start(
        self,
        sample: PreparedSample,
        prompt_indices: list[int],
        priority: int,
        used_rows: dict[int, ResultRow],
    ) -> Progress:
        """A prepared sample arrives: its prompts that need no other output go to the engine. `used_rows`
        are committed rows (a retry's) that its follow-ups use in place of running those prompts again;
        they are inputs only, not rows of this run."""
        progress = Progress(sample.shard)
        try:
            if sample.error is not None:
                raise sample.error
            if sample.chat is not None:
                check_request_schema(sample.chat.json_schema)
        except SampleError as error:  # the whole sample failed: each prompt's row says why
            progress.rows = [error_row(sample, i, self.cfg.prompts[i].name, error) for i in prompt_indices]
            progress.sample_done = True
            return progress
        follow_ups = set(prompt_indices) & self.graph.follow_ups
        limits = [_token_limit(s, sample) for s in self.cfg.prompt_samplings]
        state = _SampleState(sample, priority, limits, follow_ups, rows=dict(used_rows))
        for index in prompt_indices:
            if index in follow_ups:
                continue
            prepared = sample.prompts[index]
            error = _limit_error(state, index) or prepared.error
            if error is not None:
                self._add_row(
                    state, index, error_row(sample, index, self.cfg.prompts[index].name, error), progress
                )
            else:
                self._submit(state, index, prepared.prompt, progress)
        self._samples[(sample.shard, sample.index)] = state
        return self._advance(state, progress)

    def finish(self, tag: RowTag, row: ResultRow) -> Progress:
        """A request's row: record it, and run, skip or fail the follow-ups it was the last input of."""
        state = self._samples[(tag.shard, tag.sample_index)]
        state.in_engine -= 1
        progress = Progress(tag.shard)
        self._add_row(state, tag.prompt_index, row, progress)
        return self._advance(state, progress)

    def _submit(self, state: _SampleState, index: int, prompt: Prompt, progress: Progress) -> None:
        limit = state.max_new_tokens[index]
        assert isinstance(limit, int)  # a prompt whose limit is an error has its error row instead
        request = prompt_request(self.cfg, state.sample, index, prompt, limit, state.priority)
        progress.requests.append(request)
        state.in_engine += 1

    @staticmethod
    def _add_row(state: _SampleState, index: int, row: ResultRow, progress: Progress) -> None:
        state.rows[index] = row
        progress.rows.append(row)

    def _advance(self, state: _SampleState, progress: Progress) -> Progress:
        """Settle every waiting follow-up whose inputs all have rows. One pass in prompt order suffices: a
        prompt uses earlier prompts only, so a row settled here (a skip, an error) is there in time for
        the later prompts that use it."""
        for index in sorted(state.waiting):
            if self.graph.uses[index] <= state.rows.keys():
                state.waiting.remove(index)
                self._settle(state, index, progress)
        if not state.waiting and state.in_engine == 0:
            del self._samples[(state.sample.shard, state.sample.index)]
            progress.sample_done = True
        return progress

    def _settle(self, state: _SampleState, index: int, progress: Progress) -> None:
        prompt = self.cfg.prompts[index]
        sample = state.sample
        used = [state.rows[i] for i in sorted(self.graph.uses[index])]
        failed = next((row for row in used if row.status == "error"), None)
        if (limit_error := _limit_error(state, index)) is not None:  # its own, before its inputs'
            self._add_row(state, index, error_row(sample, index, prompt.name, limit_error), progress)
        elif failed is not None:
            error = SampleError(
                "dependency_failed",
                f"it uses prompt '{failed.prompt}', which failed ({failed.error_type}); "
                "retry-failed runs both again",
            )
            self._add_row(state, index, error_row(sample, index, prompt.name, error), progress)
        elif (reason := self._skip_reason(state, index, used)) is not None:
            self._add_row(state, index, skipped_row(sample, index, prompt.name, reason), progress)
        else:
            try:
                rendered = self._render(state, index)
            except SampleError as error:
                self._add_row(state, index, error_row(sample, index, prompt.name, error), progress)
                return
            self._submit(state, index, rendered, progress)

    def _skip_reason(self, state: _SampleState, index: int, used: list[ResultRow]) -> str | None:
        """Why the follow-up does not run for this sample (a prompt it uses was skipped, or its `when` does
        not match), written to its row; None: it runs."""
        skipped = next((row for row in used if row.status == "skipped"), None)
        if skipped is not None:
            return f"not run: it uses prompt '{skipped.prompt}', which was skipped for this sample"
        prompt = self.cfg.prompts[index]
        when = prompt.when
        if when is None:
            return None
        output = state.rows[self.graph.names.index(when.prompt)].text
        if output == when.equals if when.equals is not None else output in when.in_:
            return None
        wanted = f"is {when.equals!r}" if when.equals is not None else f"is one of {when.in_!r}"
        return (
            f"not run: prompt '{prompt.name}' runs only where the output of prompt '{when.prompt}' {wanted}"
        )

    def _render(self, state: _SampleState, index: int) -> Prompt:
        """The follow-up's prompt: its text with the outputs it uses filled in, as the next user turn of
        the conversation it continues (each turn of which is filled the same way), or a turn of its own."""
        sample = state.sample
        outputs = {self.graph.names[i]: row.text for i, row in state.rows.items() if row.status == "ok"}
        values = template_values(sample.fields, sample.key, outputs)
        turns = [index]
        while self.cfg.prompts[turns[0]].continue_ is not None:
            turns.insert(0, self.graph.names.index(self.cfg.prompts[turns[0]].continue_))
        user_texts = [fill_template(self.cfg.prompts[i].text, values) for i in turns]
        answers = [state.rows[i].text for i in turns[:-1]]
        return self.builder.conversation(user_texts, answers, sample.images)


def _token_limit(sampling: SamplingConfig, sample: PreparedSample) -> int | SampleError:
    """A prompt's token limit on the sample (an openai_batch request's own `max_tokens` first), or the
    error of a sample whose own limit (`max_new_tokens_field`) is not a positive integer: that prompt's
    error row, while prompts with limits of their own still run."""
    try:
        limit = max_new_tokens_of(sampling, sample.fields)
    except SampleError as error:
        return error
    return (sample.chat.max_tokens or limit) if sample.chat is not None else limit


def _limit_error(state: _SampleState, index: int) -> SampleError | None:
    limit = state.max_new_tokens[index]
    return limit if isinstance(limit, SampleError) else None
