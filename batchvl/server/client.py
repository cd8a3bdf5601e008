"""One HTTP exchange with an OpenAI-compatible server, and what its failure means.

A failure is one of three kinds, which decide what happens to the request (`server_engine.py`):
- `Rejected`: the server answered 4xx (other than 408 and 429): this request is wrong for it (an image its
  processor refuses, a prompt over its context). Retrying cannot help; the row says why.
- `Transient`: a timeout, 408, 429 or 5xx: worth retrying after a wait (Retry-After, when the server
  gives one).
- `Unreachable`: no answer at all (connection refused or reset): the server may be gone.
An HTTP 200 whose body is not JSON, or larger than the request's answer can be, is the request's
`server_error` row at once.

One exchange, from the connection to the answer's last byte, ends within its timeout (httpx's own
timeouts bound each socket call only: a server trickling a byte at a time would never trip them), and
no more of an answer is read than `max_bytes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import math

import httpx

from batchvl.errors import SampleError, UserError
from batchvl.utils.secrets import url_without_userinfo

ERROR_BODY_BYTES = 64 * 1024  # read of an error answer: its message is all that is kept


class Rejected(Exception):
    pass


class Transient(Exception):
    def __init__(self, message: str, retry_after_s: float | None = None, timed_out: bool = False):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.timed_out = timed_out  # no answer in time: the server may be hung


class Unreachable(Exception):
    pass


def api_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def connection(url: str, api_key: str | None) -> tuple[str, dict]:
    """The base URL of the server at `url` and the options every request to it goes with: the API key, the
    URL's user info as basic auth (the URL itself is kept without it: httpx logs each request's URL), and
    the environment's proxies (HTTP_PROXY, ...) for a server elsewhere, never for one on loopback."""
    parts = httpx.URL(url)
    auth = httpx.BasicAuth(parts.username, parts.password) if parts.username or parts.password else None
    options = {"headers": api_headers(api_key), "auth": auth, "trust_env": not is_loopback(url)}
    return url_without_userinfo(url).rstrip("/"), options


def is_loopback(url: str) -> bool:
    """Whether `url` names this machine (localhost, 127.0.0.0/8, ::1): no proxy can reach it as meant, and
    a proxy would see the API key, the images and the prompts."""
    host = httpx.URL(url).host
    try:
        return host == "localhost" or host.endswith(".localhost") or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def described(exc: BaseException) -> str:
    """An exception as `Type: message`, or its type alone where it has no message (httpx's ReadError often
    has none)."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


async def post_json(
    client: httpx.AsyncClient, path: str, body: dict, timeout_s: float, max_bytes: int
) -> dict:
    """POST `body` to `path` under the client's base URL; the answer's JSON, or one of the failures."""
    try:
        status, headers, data = await asyncio.wait_for(_exchange(client, path, body, max_bytes), timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        raise Transient(
            f"no whole answer within engine.server.timeout_s={timeout_s:g} s ({type(exc).__name__})",
            timed_out=True,
        ) from exc
    except (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
        raise Unreachable(described(exc)) from exc
    if status == 200:
        try:
            return json.loads(data)
        except ValueError as exc:  # a proxy's page: this request's answer is lost, the server may be fine
            raise SampleError("server_error", f"the server's answer is not JSON: {data[:200]!r}") from exc
    message = f"HTTP {status}: {_error_message(data)}"
    if status in (408, 429) or status >= 500:
        raise Transient(message, retry_after(headers.get("retry-after")))
    raise Rejected(message)


async def _exchange(
    client: httpx.AsyncClient, path: str, body: dict, max_bytes: int
) -> tuple[int, httpx.Headers, bytes]:
    async with client.stream("POST", path, json=body) as response:
        limit = max_bytes if response.status_code == 200 else ERROR_BODY_BYTES
        return response.status_code, response.headers, await _read_at_most(response, limit)


async def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    """The body, refused once it is over `limit` (an answer that size cannot be this request's); an error
    answer is cut there instead, its start being its message."""
    declared = response.headers.get("content-length", "")
    if response.status_code == 200 and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    # closed here when left early, rather than by the event loop once it may be stopped
    async with contextlib.aclosing(response.aiter_bytes()) as body:
        async for chunk in body:
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                if response.status_code != 200:
                    break
                raise _too_large(size, limit)
    return b"".join(chunks)[:limit]


def _too_large(size: int, limit: int) -> SampleError:
    return SampleError(
        "server_error",
        f"the server's answer is over {limit} bytes (at least {size}), more than the request's max_tokens "
        "can give; refused",
    )


def _error_message(data: bytes) -> str:
    """The server's own words: OpenAI's `{"error": {"message": ...}}`, else the body's start."""
    try:
        error = json.loads(data).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)
    except (ValueError, AttributeError):
        pass
    return data[:500].decode(errors="replace")


def retry_after(value: str | None) -> float | None:
    """Retry-After in seconds; None where it is absent or not a finite number of seconds (an HTTP date,
    `inf`, garbage): the backoff decides then."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


def served_models(url: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """The model names a server serves (`GET /models`), or a one-line UserError saying why not (naming the
    URL without its user info)."""
    shown, options = connection(url, api_key)
    try:
        response = httpx.get(f"{shown}/models", timeout=timeout_s, **options)
    except httpx.HTTPError as exc:
        raise UserError(
            f"engine.server.url {shown} does not answer ({described(exc)}); start the server, or "
            "fix the URL (it ends in /v1)"
        ) from exc
    if response.status_code != 200:
        message = _error_message(response.content)
        raise UserError(
            f"engine.server.url {shown}: GET /models answered HTTP {response.status_code} ({message}); check "
            "the URL (it ends in /v1) and engine.server.api_key_env"
        )
    try:
        return [entry["id"] for entry in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"engine.server.url {shown}: GET /models is not an OpenAI model list") from exc


def check_accepted(url: str, api_key: str | None, body: dict, what: str, timeout_s: float) -> None:
    """Send one request as a probe; a UserError naming `what` where the server refuses it (HTTP 4xx). A
    probe that fails otherwise (a timeout, 5xx) decides nothing: the run's retries meet that."""
    base, options = connection(url, api_key)
    try:
        response = httpx.post(f"{base}/chat/completions", json=body, timeout=timeout_s, **options)
    except httpx.HTTPError:
        return
    if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
        message = _error_message(response.content)
        raise UserError(
            f"the server at {base} refuses {what} (HTTP {response.status_code}: "
            f"{message}); change the prompt, or start the server with what that request needs"
        )
