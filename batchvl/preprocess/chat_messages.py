"""Prompts as chat messages for an OpenAI-compatible server, which applies the model's chat template
itself: the same turns `PromptRenderer` renders (the media, then the text, in the first user turn), with
each media part an `image_url` part holding the media's URL."""

from __future__ import annotations

from batchvl.errors import SampleError
from batchvl.preprocess.media_urls import MediaURL


class ChatMessages:
    """The `PromptBuilder` of the server backend: no tokenizer, no template, plain data."""

    def one_turn(self, text: str, media: list[MediaURL]) -> tuple[dict, ...]:
        return self.conversation([text], [], media)

    def conversation(
        self, user_texts: list[str], answers: list[str], media: list[MediaURL]
    ) -> tuple[dict, ...]:
        first = [_media_part(item) for item in media] + [{"type": "text", "text": user_texts[0]}]
        messages = [{"role": "user", "content": first}]
        for answer, text in zip(answers, user_texts[1:], strict=True):
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
            messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        return tuple(messages)

    def request(self, messages: list[dict], media: list[MediaURL]) -> tuple[dict, ...]:
        """A request's own messages, each `{"type": "image"}` part given the next media's URL."""
        parts = [part for m in messages if isinstance(m.get("content"), list) for part in m["content"]]
        if sum(map(_is_media, parts)) != len(media):
            raise SampleError(
                "prompt_mismatch", f"the messages' media parts do not match the {len(media)} media"
            )
        remaining = iter(media)
        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                content = [_media_part(next(remaining)) if _is_media(part) else part for part in content]
            out.append({**message, "content": content})
        return tuple(out)


def _is_media(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "video")


def _media_part(item: MediaURL) -> dict:
    return {"type": "image_url", "image_url": {"url": item.url}}
