"""A small OpenAI-compatible server on 127.0.0.1 for the openai backend's tests: it answers what vLLM's
server answers to batchvl (`GET /v1/models`, `GET /health`, `POST /v1/chat/completions`), with a text
derived from the request, and misbehaves on request.

A request is recognised by its text (every text part of its messages, joined): a test puts a marker in a
prompt (`{key}` makes each sample's text its own) and tells the server what to do with the requests that
contain it:
- `reject[marker] = message`: HTTP 400 with an OpenAI error body;
- `fail[marker] = Failure(status, times, retry_after)`: that status the first `times` requests, then the
  answer (times=None: always);
- `garble` (a set of markers): HTTP 200 with a web page instead of JSON (a proxy's answer);
- `stall[marker] = seconds`: wait that long before answering (a client with a shorter timeout gives up);
- `trickle[marker] = seconds`: the answer's body one byte every `seconds` (each read is quick, the whole
  answer is not);
- `chunked` (a set of markers): the answer's body in chunks without a Content-Length (a server writing its
  answer as it makes it);
- `slow_models_s`: `GET /v1/models` waits this long before answering (a busy server);
- `hold_s`: every completion waits this long (requests pile up, to count how many are in flight);
- `crash[marker] = seconds`: the server goes down for that long (a crash, then a supervisor's restart):
  this request and every one in flight or arriving meanwhile lose their connection without an answer;
- `hang_on` (a set of markers): such a request wedges the server: from then on no request is answered,
  `/health` and `/v1/models` included, and connections stay open (a stopped process, a wedged GPU);
- `gone_after = K`: after its K-th answered completion (planning's probes not counted) the server stops
  listening and drops every connection it has without an answer (a server gone mid-run).
`prompt_logprobs(body)`, where set, is the answer's `prompt_logprobs` to a request asking for them (a
scored choice). `edit(answer, body)`, where set, changes a completion's JSON answer before it is sent (a
malformed one). With `logprobs` asked for, each word of the text is a token of log-probability -0.5
(`token_id:<i>` where `return_tokens_as_token_ids` is), its candidates the same.
It records every request (path, headers, JSON body, arrival time) and the most completions in flight at
once. The answer is `reply(body)`, by default "echo: " and the last user turn's text, with `usage` token
counts of one per word.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from batchvl.pipeline.server_setup import PROBE_TEXT
from tests.http_server import InFlight


@dataclass(frozen=True)
class Failure:
    status: int
    times: int | None = None  # None: every time
    retry_after: str | None = None  # the Retry-After header's value


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict | None
    at: float = field(default_factory=time.monotonic)

    @property
    def text(self) -> str:
        return request_text(self.body or {})


def request_text(body: dict) -> str:
    """Every text part of a chat body's messages, joined by newlines."""
    texts = []
    for message in body.get("messages", []):
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content if part.get("type") == "text")
    return "\n".join(texts)


def last_user_text(body: dict) -> str:
    user = [m for m in body["messages"] if m["role"] == "user"][-1]
    return " ".join(part["text"] for part in user["content"] if part.get("type") == "text")


def echo(body: dict) -> str:
    return "echo: " + last_user_text(body)


def logprobs(content: str, body: dict) -> list[dict]:
    """A log-probability entry per word of `content`, with `top_logprobs` candidates."""
    as_ids = body.get("return_tokens_as_token_ids")
    entries = []
    for i, word in enumerate(content.split()):
        token = {"token": f"token_id:{i + 1}" if as_ids else word, "logprob": -0.5}
        entries.append({**token, "top_logprobs": [token] * body.get("top_logprobs", 0)})
    return entries


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that gave up (a timeout) is what some tests do


class FakeOpenAIServer:
    def __init__(self, model: str = "served-model", port: int = 0):
        self.models = [model]
        self.reply: Callable[[dict], str] = echo
        self.edit: Callable[[dict, dict], None] | None = None
        self.prompt_logprobs: Callable[[dict], list] | None = None
        self.reject: dict[str, str] = {}
        self.fail: dict[str, Failure] = {}
        self.garble: set[str] = set()
        self.stall: dict[str, float] = {}
        self.trickle: dict[str, float] = {}
        self.chunked: set[str] = set()
        self.slow_models_s = 0.0
        self.crash: dict[str, float] = {}
        self.hang_on: set[str] = set()
        self.hung = False
        self.down_until = 0.0
        self.hold_s = 0.0
        self.gone_after: int | None = None
        self.requests: list[Recorded] = []
        self.completed = 0  # completions answered
        self._in_flight = InFlight()
        self.gone = False
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}  # marker -> requests that had it
        self.httpd = _QuietServer(("127.0.0.1", port), _handler(self))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FakeOpenAIServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_listening()

    def stop_listening(self) -> None:
        with self._lock:
            self.gone = True
        self.httpd.shutdown()
        self.httpd.server_close()

    def completions(self, containing: str = "") -> list[Recorded]:
        """The completion requests received (whose text contains `containing`), in arrival order; the
        probes planning sends (see `probes`) only where `containing` asks for them."""
        return [
            r
            for r in self.requests
            if r.path == "/v1/chat/completions"
            and containing in r.text
            and (PROBE_TEXT not in r.text or PROBE_TEXT in containing)
        ]

    def probes(self) -> list[Recorded]:
        """The one-token requests that check which kinds of request the server takes."""
        return self.completions(PROBE_TEXT)

    def _record(self, path: str, headers, body: dict | None) -> Recorded:
        recorded = Recorded(path, dict(headers.items()), body)
        with self._lock:
            self.requests.append(recorded)
        return recorded

    def _count(self, marker: str) -> int:
        """How many requests with `marker` came so far, this one included."""
        with self._lock:
            self._seen[marker] = self._seen.get(marker, 0) + 1
            return self._seen[marker]

    @property
    def most_in_flight(self) -> int:
        return self._in_flight.most

    def _claim_answer(self, counts: bool) -> bool | None:
        """Whether a completion may be answered, counted if it `counts`: False once the server is gone;
        None for the K-th of `gone_after`, which is answered and takes the server down behind it. Decided
        before the answer is sent, so that of two completions in flight at the K-th only one is answered."""
        with self._lock:
            if self.gone:
                return False
            if not counts:
                return True
            self.completed += 1
            if self.gone_after is None or self.completed < self.gone_after:
                return True
            self.gone = True
            return None

    def _go(self) -> None:
        # shutdown waits for serve_forever's loop, which runs in another thread
        threading.Thread(target=self.stop_listening, daemon=True).start()

    @property
    def down(self) -> bool:
        return self.gone or time.monotonic() < self.down_until

    def wait_while_hung(self) -> None:
        while self.hung and not self.gone:
            time.sleep(0.02)

    def crashes(self, body: dict) -> bool:
        """Whether this request brings the server down (for its `crash` seconds)."""
        text = request_text(body)
        seconds = max((s for marker, s in self.crash.items() if marker in text), default=None)
        if seconds is not None:
            self.down_until = time.monotonic() + seconds
        return seconds is not None

    def completion(self, body: dict) -> tuple[int, dict, dict | bytes]:
        """(status, headers, body: JSON or bytes) of the answer to a completion request."""
        text = request_text(body)
        if any(marker in text for marker in self.hang_on):
            self.hung = True
            self.wait_while_hung()
        for marker, message in self.reject.items():
            if marker in text:
                return 400, {}, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
        for marker, failure in self.fail.items():
            if marker in text and (failure.times is None or self._count(marker) <= failure.times):
                headers = {"Retry-After": failure.retry_after} if failure.retry_after is not None else {}
                error = {"message": f"busy ({failure.status})", "type": "ServiceUnavailable"}
                return failure.status, headers, {"error": error}
        if any(marker in text for marker in self.garble):
            return 200, {"Content-Type": "text/html"}, b"<html><body>Bad gateway</body></html>"
        for marker, seconds in self.stall.items():
            if marker in text:
                time.sleep(seconds)
        time.sleep(self.hold_s)
        content = self.reply(body)
        answer = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": len(text.split()),
                "completion_tokens": len(content.split()),
                "total_tokens": len(text.split()) + len(content.split()),
            },
        }
        if body.get("logprobs"):
            answer["choices"][0]["logprobs"] = {"content": logprobs(content, body)}
        if body.get("prompt_logprobs") is not None and self.prompt_logprobs is not None:
            answer["prompt_logprobs"] = self.prompt_logprobs(body)
        if self.edit is not None:
            self.edit(answer, body)
        return 200, {}, answer


def _handler(server: FakeOpenAIServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            server._record(self.path, self.headers, None)
            server.wait_while_hung()
            if server.down:
                return self._drop()
            if self.path == "/v1/models":
                time.sleep(server.slow_models_s)
                data = [{"id": name, "object": "model", "owned_by": "fake"} for name in server.models]
                return self._send(200, {"object": "list", "data": data})
            if self.path == "/health":
                return self._send(200, {})
            return self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length))
            server._record(self.path, self.headers, body)
            server.wait_while_hung()
            if server.down or server.crashes(body):
                return self._drop()
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            with server._in_flight.counting():
                status, headers, answer = server.completion(body)
            if server.down:  # went down while this one waited
                return self._drop()
            # planning's probes do not count towards gone_after
            claim = server._claim_answer(status == 200 and PROBE_TEXT not in json.dumps(body))
            if claim is False:
                return self._drop()
            trickle = next((s for m, s in server.trickle.items() if m in request_text(body)), None)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up
                if any(marker in request_text(body) for marker in server.chunked):
                    self._send_chunked(status, answer)
                else:
                    self._send(status, answer, headers, trickle)
            if claim is None:
                server._go()

        def _drop(self) -> None:
            """No answer: the connection closes, as a killed server's does."""
            self.close_connection = True

        def _send_chunked(self, code: int, payload: dict | bytes, size: int = 16 * 1024) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(data), size):
                chunk = data[start : start + size]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def _send(
            self, code: int, payload: dict | bytes, headers: dict | None = None, trickle: float | None = None
        ) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if trickle is None:
                self.wfile.write(data)
                return
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(trickle)

    return Handler
