"""Render each (sample, prompt) with the model's chat template and expand image placeholders.

Contract: ONE user turn holding the sample's image(s) followed by the prompt text, rendered with
`add_generation_prompt=True` (a follow-up prompt that continues another's conversation adds that
prompt's answer and its own user turn after it). Each media placeholder token then becomes the media's
placeholder text (as many placeholder tokens as the media has embedding rows, with the family's markers
between tiles or frames), exactly as the model's processor does.
"""

from __future__ import annotations

import re
from typing import Any

from batchvl.errors import SampleError
from batchvl.preprocess.media import PreparedMedia

# `{name}` with an identifier inside; `{{` and `}}` are literal braces. Other braces (e.g. a JSON example
# in the prompt) are left alone, so a prompt without fields never needs escaping.
TEMPLATE_FIELD = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


def template_fields(text: str) -> list[str]:
    """The field names a prompt text inserts, in order."""
    return [match.group(1) for match in TEMPLATE_FIELD.finditer(text) if match.group(1)]


def template_values(
    fields: dict[str, Any], key: str, outputs: dict[str, str] | None = None
) -> dict[str, Any]:
    """What a prompt's `{name}` inserts: the sample's field of that name, `{key}` its key, and an earlier
    prompt's name that prompt's output, which wins over a field of the same name (as the prompt graph reads
    such a name: a use of that prompt)."""
    return {**fields, "key": key, **(outputs or {})}


def fill_template(text: str, fields: dict[str, Any]) -> str:
    """Insert the sample's fields into a prompt; a missing or empty field is that request's error."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name is None:
            return match.group(0)[0]
        value = fields.get(name)
        if value is None:
            available = ", ".join(sorted(fields)) or "none"
            raise SampleError(
                "missing_field", f"prompt uses field '{name}', which this sample lacks (has: {available})"
            )
        return str(value)

    return TEMPLATE_FIELD.sub(replace, text)


class PromptRenderer:
    """Chat-template rendering and tokenization, the same for every family: each media placeholder token of
    the rendered text is replaced by that media's own `placeholder` text (as the family's processor does),
    then the text is tokenized as the processor tokenizes it."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.placeholder_kinds = {processor.image_token: "image"}
        video_token = getattr(processor, "video_token", None)
        if video_token:
            self.placeholder_kinds[video_token] = "video"
        tokens = sorted(self.placeholder_kinds, key=len, reverse=True)  # longest first: no prefix shadowing
        self._placeholders = re.compile("(" + "|".join(re.escape(token) for token in tokens) + ")")

    def render(self, prompt_text: str, media_kinds: int | list[str]) -> str:
        """Chat-template text of one user turn: the media (an int: that many images), then the text."""
        return self.render_conversation([prompt_text], [], media_kinds)

    def render_conversation(
        self, user_texts: list[str], answers: list[str], media_kinds: int | list[str]
    ) -> str:
        """Chat-template text of a conversation: user turns with the model's answers between them (one
        fewer), the media in the first user turn, ending where the model answers the last turn. Its first
        turn renders as `render` renders that turn alone, so a follow-up shares its prompt's prefix."""
        kinds = ["image"] * media_kinds if isinstance(media_kinds, int) else media_kinds
        first = [{"type": kind} for kind in kinds] + [{"type": "text", "text": user_texts[0]}]
        messages = [{"role": "user", "content": first}]
        for answer, text in zip(answers, user_texts[1:], strict=True):
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
            messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def render_messages(self, messages: list[dict]) -> str:
        """Chat-template text of a request's own messages (image parts as `{"type": "image"}`), ending where
        the model answers."""
        return self.processor.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    def one_turn(self, text: str, media: list[PreparedMedia]) -> list[int]:
        """The token ids of one user turn: the media, then the text."""
        return self.token_ids(self.render(text, [m.kind for m in media]), media)

    def conversation(
        self, user_texts: list[str], answers: list[str], media: list[PreparedMedia]
    ) -> list[int]:
        """The token ids of a conversation (`render_conversation`)."""
        rendered = self.render_conversation(user_texts, answers, [m.kind for m in media])
        return self.token_ids(rendered, media)

    def request(self, messages: list[dict], media: list[PreparedMedia]) -> list[int]:
        """The token ids of a request's own messages (`render_messages`)."""
        return self.token_ids(self.render_messages(messages), media)

    def token_ids(self, rendered: str, media: list[PreparedMedia]) -> list[int]:
        pieces = self._placeholders.split(rendered)  # text, placeholder, text, ..., text
        found = [self.placeholder_kinds[token] for token in pieces[1::2]]
        if found != [m.kind for m in media]:
            raise SampleError(
                "prompt_mismatch",
                f"rendered prompt has placeholders {found} for media {[m.kind for m in media]}",
            )
        for i, item in enumerate(media):
            pieces[2 * i + 1] = item.placeholder
        return self.tokenizer("".join(pieces))["input_ids"]
