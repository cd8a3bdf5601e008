"""The openai backend: the engine interface the job loop drives (`add_request`, `step`, `wants_requests`,
`num_unfinished`, `stats`), over an OpenAI-compatible server.

Requests run as asyncio tasks on an event loop in a thread of their own, at most
`engine.server.max_concurrency` HTTP exchanges at once; `wants_requests` is false while that many requests
are unfinished, so the job stops reading input ahead while the server is busy. `step` hands back the
requests that finished since the last step, waiting briefly for one when none has.

What a failure becomes (see `client.py` for the kinds): a rejected request is a `server_rejected` row; a
transient failure is retried with backoff and, after `retries`, is a `server_error` row. A request that
finds no server, or no answer in time, checks whether the server still answers (a hung server times out
there too); if it does not, the backend restarts a server it launched (at most `retries` times in a row
without an answered request) and retries the request, or, with no server left, declares it gone: `step`
raises `ServerGone`, and the requests it failed on are never results (the job stops, and a rerun runs
them). Every retry after the server came back counts and waits its backoff, and the request goes alone
(nothing else in flight): one that brings the server down each time it is sent alone is, after its
retries, a `server_crash` row, and the rest of the job goes on: the restart after it is its own, not
counted against the next request. A server that dies whatever it is sent (or by itself) is thus restarted
`retries` + 1 times in all, then gone, rather than once more for every request of the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future

import httpx

from batchvl.config import ServerConfig
from batchvl.engine.request import EngineRequest, EngineResult
from batchvl.engine.sampling.choice_scoring import ChoiceTokenizer
from batchvl.engine.stats import EngineStats
from batchvl.errors import SampleError, ServerGone
from batchvl.server import answers, payloads
from batchvl.server.client import Rejected, Transient, Unreachable, connection, described, post_json
from batchvl.server.process import ManagedServer
from batchvl.utils.queues import take_ready

logger = logging.getLogger(__name__)

STEP_WAIT_S = 0.05  # how long a step waits for a finished request when none is ready
# How long a server that answers may take to list its models: the request's timeout, within these bounds
# (a busy server, or a loaded machine, can take a moment over a short request timeout)
HEALTH_TIMEOUT_S = (2.0, 10.0)
LOGGED_WAIT_S = 5.0  # a wait before a retry this long or longer is logged: the job is not hung


class ServerEngine:
    num_engines = 1

    def __init__(
        self,
        url: str,
        model: str,
        config: ServerConfig,
        api_key: str | None = None,
        tokenizer=None,
        choice_tokens: ChoiceTokenizer | None = None,
        server: ManagedServer | None = None,
    ):
        self.url = url
        self.model = model
        self.config = config
        self.api_key = api_key
        self.tokenizer = tokenizer  # the model's, where model.path has one: choice scores, token texts
        self.choice_tokens = choice_tokens  # scored choices' tokens, each ending in end-of-sequence
        self.server = server
        self.restarts = 0
        # restarts since a request was last answered
        self.restarts_in_a_row = 0
        # a request was just given up as the one that brings the server down: the restart that follows is
        # on that request's account, once
        self._restart_owed = False
        self._stats = EngineStats()
        self._finished: queue.Queue[Future] = queue.Queue()
        self._unfinished = 0
        self._gone: ServerGone | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="batchvl-server-client", daemon=True
        )
        self._thread.start()
        self._call(self._open())

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_unfinished(self) -> int:
        return self._unfinished

    @property
    def wants_requests(self) -> bool:
        return self._unfinished < self.config.max_concurrency

    def add_request(self, item: EngineRequest) -> None:
        if item.messages is None:
            raise ValueError("the server backend takes requests with chat messages")
        self._unfinished += 1
        self._stats.images_total += len(item.images)
        future = asyncio.run_coroutine_threadsafe(self._complete(item), self._loop)
        future.add_done_callback(self._finished.put)

    def step(self) -> list[EngineResult]:
        """The requests finished since the last step (waiting up to STEP_WAIT_S for one when none is)."""
        futures = take_ready(self._finished, STEP_WAIT_S if self._unfinished else 0)
        results, gone = [], []
        for future in futures:
            error = future.exception()
            if isinstance(error, ServerGone):
                gone.append(future)
                continue
            self._unfinished -= 1
            if error is not None:
                raise error  # a bug: every other failure is the request's result
            results.append(future.result())
        if gone and not results:
            raise gone[0].exception()
        # A server gone with results finished before it: they go back first (their shards can commit),
        # and the next step raises.
        for future in gone:
            self._finished.put(future)
        self._stats.steps += 1
        return results

    def close(self) -> None:
        """Cancel what is in flight, close the connections and the loop, and stop a launched server."""
        try:
            if self._loop.is_running():
                self._call(self._shutdown())
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
        finally:
            if self.server is not None:
                self.server.stop()

    # On the event loop's thread from here on.

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _open(self) -> None:
        base_url, options = connection(self.url, self.api_key)
        self.url = base_url
        self._client = httpx.AsyncClient(
            base_url=base_url,
            **options,
            timeout=self.config.timeout_s,
            limits=httpx.Limits(max_connections=self.config.max_concurrency),
        )
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._recovering = asyncio.Lock()
        self._alone = asyncio.Lock()

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    async def _complete(self, item: EngineRequest) -> EngineResult:
        started = time.perf_counter()
        try:
            if item.scored_choices is not None:
                result = await self._score_choices(item)
            else:
                result = await self._generate(item)
        except SampleError as error:
            result = EngineResult(item.tag, error=error)
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # what `answers` does not check
            error = SampleError("server_error", f"the server's answer cannot be used ({described(exc)})")
            result = EngineResult(item.tag, error=error)
        result.latency_s = time.perf_counter() - started
        self._stats.prompt_tokens += result.num_prompt_tokens
        self._stats.output_tokens += result.num_output_tokens
        return result

    async def _generate(self, item: EngineRequest) -> EngineResult:
        body = payloads.chat_body(self.model, item, token_ids=self.tokenizer is not None)
        answer = answers.generated(
            await self._post(body), self.model, body["max_tokens"], item.sampling.wants_logprobs
        )
        result = EngineResult(
            item.tag,
            text=answer.text,
            finish_reason=answer.finish_reason,
            num_prompt_tokens=answer.prompt_tokens,
            num_output_tokens=answer.completion_tokens,
            # the server's grammar ended the output only where it was complete, but for the token limit
            is_complete=item.constraint is None or answer.finish_reason != "length",
        )
        if item.sampling.wants_logprobs:
            self._add_logprobs(result, answer.logprobs, item.sampling.top_logprobs)
        return result

    def _add_logprobs(self, result: EngineResult, content: list[dict], top_logprobs: int) -> None:
        result.token_logprobs = [payloads.logprob_of(entry) for entry in content]
        if top_logprobs:
            result.top_logprobs = [
                [self._token(candidate) for candidate in entry["top_logprobs"][:top_logprobs]]
                for entry in content
            ]

    def _token(self, entry: dict) -> tuple[str, int | None, float]:
        token_id, text = payloads.token_of(entry)
        if token_id is not None and self.tokenizer is not None:
            text = self.tokenizer.decode([token_id])
        return text, token_id, payloads.logprob_of(entry)

    async def _score_choices(self, item: EngineRequest) -> EngineResult:
        if self.choice_tokens is None:
            raise SampleError("server_error", "scoring choices needs the model's tokenizer at model.path")
        token_ids = self.choice_tokens(item.scored_choices)
        written = [payloads.choice_answer(choice, self.choice_tokens) for choice in item.scored_choices]
        bodies = [payloads.choice_body(self.model, item, answer) for answer in written]
        posted = await asyncio.gather(*(self._post(body) for body in bodies))
        responses = [answers.checked(response, self.model) for response in posted]
        k = item.sampling.top_logprobs
        scored = [payloads.scored_tokens(r, ids, k) for r, ids in zip(responses, token_ids, strict=True)]
        scores = [sum(s.logprobs) for s in scored]
        best = max(range(len(scores)), key=scores.__getitem__)  # the first of equals, as the engine
        result = EngineResult(
            item.tag,
            output_token_ids=list(token_ids[best]),
            text=item.scored_choices[best],
            finish_reason="stop",
            num_prompt_tokens=responses[best]["usage"]["prompt_tokens"] - len(token_ids[best]),
            choice_logprobs=scores,
        )
        if item.sampling.wants_logprobs:
            result.token_logprobs = scored[best].logprobs
            if k:
                decode = self.tokenizer.decode
                result.top_logprobs = [[(decode([t]), t, v) for t, v in pos] for pos in scored[best].top]
        return result

    async def _post(self, body: dict) -> dict:
        """One chat completion, retried as the module says; a SampleError where it ends as a row."""
        attempt, suspect = 0, False
        while True:
            alone = suspect or self.config.max_concurrency == 1
            try:
                async with self._sending(alone):
                    if suspect and not await self._answers():
                        await self._recover()  # down from another request's crash: not this one's doing
                    answer = await post_json(
                        self._client,
                        "/chat/completions",
                        body,
                        self.config.timeout_s,
                        payloads.answer_limit(body),
                    )
                self.restarts_in_a_row = 0
                self._restart_owed = False
                return answer
            except Rejected as exc:
                raise SampleError("server_rejected", f"the server refused the request: {exc}") from exc
            except (Unreachable, Transient) as exc:
                failure, wait = exc, getattr(exc, "retry_after_s", None)
                lost = isinstance(exc, Unreachable) or exc.timed_out
                if lost and not await self._answers():
                    # The server died or hung with this request in flight: it counts, and is sent alone
                    # from now on, so that a request that brings the server down each time is known as
                    # such (an error row) rather than sent again after every recovery.
                    attempt += 1
                    if alone and attempt > self.config.retries:
                        self._restart_owed = True  # the request that brought it down is done
                        raise SampleError(
                            "server_crash",
                            f"the server stopped answering each time this request was sent ({attempt} times, "
                            f"the last alone): {failure}",
                        ) from exc
                    await self._recover()
                    suspect = True
                    await self._back_off(attempt, f"the server stopped answering: {failure}")
                    continue
            attempt += 1
            if attempt > self.config.retries:
                raise SampleError(
                    "server_error", f"the request failed after {self.config.retries} retries: {failure}"
                )
            await self._back_off(attempt, f"{failure}", wait)

    @contextlib.asynccontextmanager
    async def _sending(self, alone: bool):
        """A slot to send a request in; `alone`: every slot, so that nothing else is in flight with it."""
        wanted, held = self.config.max_concurrency if alone else 1, 0
        try:
            async with self._alone if alone else contextlib.nullcontext():  # one request alone at a time
                while held < wanted:
                    await self._slots.acquire()
                    held += 1
            yield
        finally:
            for _ in range(held):
                self._slots.release()

    async def _back_off(self, attempt: int, why: str, retry_after_s: float | None = None) -> None:
        """Wait before retry number `attempt`: as the server's Retry-After says, else `backoff_s` doubled
        per attempt, never longer than `max_retry_wait_s` (a server may say a day, or `inf`)."""
        wait = retry_after_s if retry_after_s is not None else self.config.backoff_s * 2 ** (attempt - 1)
        wait = min(wait, self.config.max_retry_wait_s)
        if wait >= LOGGED_WAIT_S:
            logger.warning("waiting %.0f s before retrying (%s)", wait, why)
        await asyncio.sleep(wait)

    async def _answers(self) -> bool:
        try:
            low, high = HEALTH_TIMEOUT_S
            timeout = min(high, max(low, self.config.timeout_s))
            return (await self._client.get("/models", timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _recover(self) -> None:
        """Wait for the server to answer again, restarting a launched one that died; raise ServerGone when
        it does not come back."""
        async with self._recovering:  # one request recovers; the others find it done
            if self._gone is not None:
                raise self._gone
            for attempt in range(self.config.retries + 1):
                if await self._answers():
                    return
                if (
                    self.server is not None
                    and not self.server.is_alive()
                    and (self._restart_owed or self.restarts_in_a_row < self.config.retries)
                ):
                    self.restarts += 1
                    if self._restart_owed:
                        self._restart_owed = False
                        logger.warning("the server died on a request given up; restarting it")
                    else:
                        self.restarts_in_a_row += 1
                        logger.warning(
                            "the server died; restarting it (%d of %d in a row)",
                            self.restarts_in_a_row,
                            self.config.retries,
                        )
                    try:
                        await asyncio.to_thread(self.server.restart)
                    except Exception as exc:  # a restart that fails is the server gone
                        logger.error("restarting the server failed: %s", exc)
                        break
                    self._client_base_moved()
                    continue
                await self._back_off(attempt + 1, "the server does not answer")
            self._gone = ServerGone(
                f"the server at {self.url} stopped answering (after "
                f"{self.config.retries} retries"
                + (f" and {self.restarts} restart(s)" if self.server is not None else "")
                + ")"
            )
            raise self._gone

    def _client_base_moved(self) -> None:
        """A restarted server listens on a new port."""
        self.url = self.server.url
        self._client.base_url = self.url
