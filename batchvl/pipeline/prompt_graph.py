"""Which prompts use which: a follow-up prompt uses an earlier prompt's output of the same sample.

A prompt uses an earlier one when its text inserts that prompt's output (`{caption}`: a template name
that is a prompt's name means that prompt, before any sample field of the name), when it `continue`s
that prompt's conversation, or when its `when` tests that prompt's output. Only earlier prompts can be
used, so the prompts run in list order and nothing waits on itself; a reference to the prompt itself, a
later prompt or an unknown prompt is refused before any work (exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchvl.config import PromptConfig
from batchvl.errors import UserError
from batchvl.preprocess.prompts import template_fields


@dataclass(frozen=True)
class PromptGraph:
    names: tuple[str, ...]
    uses: tuple[frozenset[int], ...]  # per prompt, the earlier prompts whose outputs it needs

    @classmethod
    def of(cls, prompts: list[PromptConfig]) -> PromptGraph:
        names = tuple(prompt.name for prompt in prompts)
        uses = []
        for index, prompt in enumerate(prompts):
            used = {
                _earlier(names, index, name, f"{{{name}}}")
                for name in template_fields(prompt.text)
                if name in names
            }
            if prompt.continue_ is not None:
                used.add(_earlier(names, index, prompt.continue_, "'continue'"))
            if prompt.when is not None:
                used.add(_earlier(names, index, prompt.when.prompt, "'when'"))
                _check_when_values(prompt, prompts[names.index(prompt.when.prompt)])
            uses.append(frozenset(used))
        return cls(names, tuple(uses))

    @property
    def follow_ups(self) -> frozenset[int]:
        """The prompts that use another's output (rendered once that output exists)."""
        return frozenset(index for index, used in enumerate(self.uses) if used)

    def with_what_they_use(self, selected: frozenset[int]) -> frozenset[int]:
        """The selected prompts and every prompt they use, directly or through another."""
        closed = set(selected)
        for index in range(len(self.names) - 1, -1, -1):  # one pass: a prompt uses earlier ones only
            if index in closed:
                closed |= self.uses[index]
        return frozenset(closed)


def _earlier(names: tuple[str, ...], index: int, name: str, where: str) -> int:
    """The index of the earlier prompt `name` that prompt `index` uses in `where`."""
    me = names[index]
    if name not in names:
        raise UserError(
            f"prompt '{me}': {where} names '{name}', which is no prompt of this job {list(names)}"
        )
    used = names.index(name)
    if used == index:
        raise UserError(
            f"prompt '{me}': {where} names the prompt itself (a prompt's name in braces is its output); to "
            f"use the sample's field '{name}', rename the prompt, or use an earlier prompt's output"
        )
    if used > index:
        raise UserError(
            f"prompt '{me}': {where} refers to prompt '{name}', which comes later; list '{me}' after '{name}'"
        )
    return used


def _check_when_values(prompt: PromptConfig, tested: PromptConfig) -> None:
    """A `when` on a choices prompt can only match its choices (a typo would skip every sample)."""
    wanted = [prompt.when.equals] if prompt.when.equals is not None else prompt.when.in_
    if tested.choices is None:
        return
    unknown = [value for value in wanted if value not in tested.choices]
    if unknown:
        raise UserError(
            f"prompt '{prompt.name}': 'when' tests {unknown} but prompt '{tested.name}' answers only "
            f"one of {tested.choices}"
        )
