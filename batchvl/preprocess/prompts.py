"""Render each (sample, prompt) with the model's chat template and expand image placeholders.

Contract: ONE user turn holding the sample's image(s) followed by the prompt text, rendered with
`add_generation_prompt=True`. Each image placeholder token then becomes as many placeholders as the
image has merged patches, exactly as the model's processor does.
"""

from __future__ import annotations

import re
from typing import Any

from batchvl.errors import SampleError
from batchvl.preprocess.media import PreparedImage

# `{name}` with an identifier inside; `{{` and `}}` are literal braces. Other braces (e.g. a JSON example
# in the prompt) are left alone, so a prompt without fields never needs escaping.
TEMPLATE_FIELD = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


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
    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        video_token = getattr(processor, "video_token", None) or "<|video_pad|>"
        self.placeholder_ids = {
            "image": self.tokenizer.convert_tokens_to_ids(processor.image_token),
            "video": self.tokenizer.convert_tokens_to_ids(video_token),
        }
        self.merge_length = processor.image_processor.merge_size**2

    def render(self, prompt_text: str, media_kinds: int | list[str]) -> str:
        """Chat-template text of one user turn: the media (an int: that many images), then the text."""
        kinds = ["image"] * media_kinds if isinstance(media_kinds, int) else media_kinds
        content = [{"type": kind} for kind in kinds] + [{"type": "text", "text": prompt_text}]
        messages = [{"role": "user", "content": content}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def token_ids(self, rendered: str, media: list[PreparedImage]) -> list[int]:
        ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        kind_of = {token: kind for kind, token in self.placeholder_ids.items()}
        found = [kind_of[token] for token in ids if token in kind_of]
        if found != [m.kind for m in media]:
            raise SampleError(
                "prompt_mismatch",
                f"rendered prompt has placeholders {found} for media {[m.kind for m in media]}",
            )
        counts = iter(m.grid_thw[0] * m.grid_thw[1] * m.grid_thw[2] // self.merge_length for m in media)
        expanded: list[int] = []
        for token in ids:
            if token in kind_of:
                expanded.extend([token] * next(counts))
            else:
                expanded.append(token)
        return expanded
