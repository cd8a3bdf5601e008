"""One HTTP exchange with an OpenAI-compatible server, and what its failure means.

A failure is one of three kinds, which decide what happens to the request (`backend.py`):
- `Rejected`: the server answered 4xx (other than 408 and 429): this request is wrong for it (an image its
  processor refuses, a prompt over its context). Retrying cannot help; the row says why.
- `Transient`: a timeout, 408, 429 or 5xx: worth retrying after a wait (Retry-After, when the server
  gives one).
- `Unreachable`: no answer at all (connection refused or reset): the server may be gone.
An HTTP 200 whose body is not JSON is the request's `server_error` row at once.
"""

from __future__ import annotations

import httpx

from batchvl.errors import SampleError, UserError


class Rejected(Exception):
    pass


class Transient(Exception):
    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unreachable(Exception):
    pass


def api_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def post_json(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """POST `body` to `path` under the client's base URL; the answer's JSON, or one of the failures."""
    try:
        response = await client.post(path, json=body)
    except httpx.TimeoutException as exc:
        raise Transient(f"no answer within the timeout ({type(exc).__name__})") from exc
    except (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
        raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
    if response.status_code == 200:
        try:
            return response.json()
        except ValueError as exc:  # a proxy's page: this request's answer is lost, the server may be fine
            raise SampleError(
                "server_error", f"the server's answer is not JSON: {response.text[:200]!r}"
            ) from exc
    message = f"HTTP {response.status_code}: {_error_message(response)}"
    if response.status_code in (408, 429) or response.status_code >= 500:
        raise Transient(message, _retry_after(response))
    raise Rejected(message)


def _error_message(response: httpx.Response) -> str:
    """The server's own words: OpenAI's `{"error": {"message": ...}}`, else the body's start."""
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)
    except (ValueError, AttributeError):
        pass
    return response.text[:500]


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def served_models(url: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """The model names a server serves (`GET /models`), or a one-line UserError saying why not."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/models", headers=api_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise UserError(
            f"engine.server.url {url} does not answer ({type(exc).__name__}: {exc}); start the server, or "
            "fix the URL (it ends in /v1)"
        ) from exc
    if response.status_code != 200:
        raise UserError(
            f"engine.server.url {url}: GET /models answered HTTP {response.status_code} "
            f"({_error_message(response)}); check the URL (it ends in /v1) and engine.server.api_key_env"
        )
    try:
        return [entry["id"] for entry in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"engine.server.url {url}: GET /models is not an OpenAI model list") from exc


def check_accepted(url: str, api_key: str | None, body: dict, what: str, timeout_s: float) -> None:
    """Send one request as a probe; a UserError naming `what` where the server refuses it (HTTP 4xx). A
    probe that fails otherwise (a timeout, 5xx) decides nothing: the run's retries meet that."""
    try:
        response = httpx.post(
            f"{url.rstrip('/')}/chat/completions", json=body, headers=api_headers(api_key), timeout=timeout_s
        )
    except httpx.HTTPError:
        return
    if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
        raise UserError(
            f"the server at {url} refuses {what} (HTTP {response.status_code}: {_error_message(response)}); "
            "use a server that takes it (vLLM does), or change the prompt"
        )
