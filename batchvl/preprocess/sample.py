"""One sample -> everything the engine needs, computed in a worker process and never raising.

Decode and convert each image, resize/crop/patchify it (its normalization is the vision call's), hash
it, then fill, render and tokenize each prompt with placeholders expanded. Whatever goes wrong becomes an
error on the sample (bad media) or on one prompt (a template field the sample lacks); the result is plain
data that pickles cheaply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchvl.config import PromptConfig
from batchvl.errors import SampleError
from batchvl.inputs.download import DownloadCache, DownloadStats
from batchvl.inputs.types import ChatRequest, MediaRef, Sample
from batchvl.preprocess.media import PreparedMedia
from batchvl.preprocess.media_urls import MediaURL
from batchvl.preprocess.prompts import fill_template, template_values

logger = logging.getLogger(__name__)


# A rendered prompt as the engine takes it: token ids for the built-in engine, chat messages (media as
# URLs) for a server
Prompt = list[int] | tuple[dict, ...]


class PromptBuilder(Protocol):
    """Renders prompts for one backend: `PromptRenderer` (token ids) or `ChatMessages` (messages)."""

    def one_turn(self, text: str, media: list) -> Prompt: ...

    def conversation(self, user_texts: list[str], answers: list[str], media: list) -> Prompt: ...

    def request(self, messages: list[dict], media: list) -> Prompt: ...


@dataclass
class PreparedPrompt:
    prompt: Prompt | None  # None: an error, or a follow-up prompt the job renders later
    error: SampleError | None = None


@dataclass
class PreparedSample:
    shard: str
    index: int
    key: str
    fields: dict[str, Any]
    num_images: int
    images: list[PreparedMedia] | list[MediaURL] = field(default_factory=list)
    prompts: list[PreparedPrompt] = field(default_factory=list)
    error: SampleError | None = None  # the whole sample failed: every prompt becomes an error row
    preprocess_s: float = 0.0
    downloads: DownloadStats | None = None  # what fetching its URL media did (None: it has none)
    chat: ChatRequest | None = None  # an openai_batch request: its own messages and sampling

    @classmethod
    def failed(cls, sample: Sample, error: SampleError) -> PreparedSample:
        return cls(
            sample.shard,
            sample.index,
            sample.key,
            sample.fields,
            len(sample.images),
            error=error,
            downloads=sample.downloads,
            chat=sample.chat,
        )


class SampleProcessor:
    def __init__(
        self,
        builder: PromptBuilder,
        prepare_media: Callable[[MediaRef], PreparedMedia | MediaURL],
        prompts: list[PromptConfig],
        follow_ups: frozenset[int] = frozenset(),
        download_cache: DownloadCache | None = None,
    ):
        self.builder = builder
        self.prepare_media = prepare_media
        self.prompts = prompts
        self.follow_ups = follow_ups  # prompts that use an earlier output: the job renders them later
        self.download_cache = download_cache  # input.download.cache_dir: bodies kept only if they decode

    def __call__(self, sample: Sample) -> PreparedSample:
        start = time.perf_counter()
        try:
            prepared = self._process(sample)
        except SampleError as exc:
            prepared = PreparedSample.failed(sample, exc)
        except Exception as exc:  # bad input must never end the job; keep the traceback for debugging
            logger.debug("preprocessing %s/%s failed", sample.shard, sample.key, exc_info=True)
            prepared = PreparedSample.failed(
                sample, SampleError("preprocess_error", f"{type(exc).__name__}: {exc}")
            )
        prepared.preprocess_s = time.perf_counter() - start
        prepared.downloads = sample.downloads
        return prepared

    def _prepare(self, ref: MediaRef) -> PreparedMedia | MediaURL:
        try:
            return self.prepare_media(ref)
        except Exception:
            # A downloaded body that does not decode (an error page served with 200, a cut-off body) must
            # not stay cached: a retry or rerun asks the server again.
            if ref.url and self.download_cache is not None:
                self.download_cache.forget(ref.url)
            raise

    def _process(self, sample: Sample) -> PreparedSample:
        if sample.error is not None:
            raise sample.error
        images = [self._prepare(ref) for ref in sample.images]
        prepared = PreparedSample(
            sample.shard,
            sample.index,
            sample.key,
            sample.fields,
            len(images),
            images=images,
            chat=sample.chat,
        )
        if sample.chat is not None:  # the request's messages are its one prompt
            try:
                prompt = self.builder.request(list(sample.chat.messages), images)
            except SampleError:
                raise
            except Exception as exc:  # the template's own checks (roles out of order, ...) raise anything
                raise SampleError(
                    "bad_request", f"the model's chat template refused the messages: {exc}"
                ) from exc
            prepared.prompts.append(PreparedPrompt(prompt))
            return prepared
        values = template_values(sample.fields, sample.key)
        for index, prompt in enumerate(self.prompts):
            if index in self.follow_ups:
                prepared.prompts.append(PreparedPrompt(None))
                continue
            try:
                prepared.prompts.append(
                    PreparedPrompt(self.builder.one_turn(fill_template(prompt.text, values), images))
                )
            except SampleError as exc:
                prepared.prompts.append(PreparedPrompt(None, exc))
        return prepared
