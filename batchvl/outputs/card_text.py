"""Text the dataset card quotes (prompt text and names, regexes, label values: written by users or by a
model) as Markdown that shows it as written: never as HTML that the card's reader renders or that hides
the rest of the card, never a table row cut short, never characters that hide or reorder what a reader
sees."""

from __future__ import annotations

import re
import unicodedata

# Unicode's directional formatting characters reorder the text around them on screen, so a prompt
# could read otherwise than what the model was given
DIRECTION_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
# what would start emphasis, code, a link, strikethrough or a heading; `&`, `<` and `>` become entities
MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_\[\]~#])")
HTML_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def visible(text: object) -> str:
    """The text on one line (whitespace runs as one space: a table row is one line), with control and
    direction characters written as their escapes (`\\u0000`, `\\u202e`)."""
    return "".join(_escaped(char) for char in " ".join(str(text).split()))


def _escaped(char: str) -> str:
    hidden = unicodedata.category(char) == "Cc" or char in DIRECTION_CONTROLS
    return f"\\u{ord(char):04x}" if hidden else char


def text(value: object) -> str:
    """Plain text, shown as written."""
    escaped = MARKDOWN_PUNCTUATION.sub(r"\\\1", visible(value))
    return "".join(HTML_ENTITIES.get(char, char) for char in escaped)


def code(value: object) -> str:
    """A code span holding the text as written: its fence is longer than any run of backticks inside
    (nothing is escaped in a code span, so HTML there is shown, not rendered)."""
    inner = visible(value)
    fence = "`" * (max(map(len, re.findall("`+", inner)), default=0) + 1)
    pad = " " if inner.startswith("`") or inner.endswith("`") else ""  # one space each side is dropped
    return f"{fence}{pad}{inner}{pad}{fence}"


def cell(markdown: str) -> str:
    """Markdown that stays inside one table cell: a table splits its rows at every `|` not escaped, in
    code spans too, and unescapes `\\|` before reading the cell."""
    return markdown.replace("|", "\\|")
