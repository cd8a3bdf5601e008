"""A real HTTP server on 127.0.0.1 for the download tests, serving every kind of answer a crawl meets.

Paths:
- /img/<name>: an image registered with `add_image` (404 if unknown); /redirect/<name> 302s to it
- /status/<code>: always that status; /flaky/<code>/<n>/<id>: <code> for the first n requests of <id>,
  then the image 'flaky' (Retry-After: 0 on a 429)
- /stall: headers, then nothing; /trickle: a byte every 0.1 s, forever
- /endless: a chunked body that never ends; /big: a Content-Length over any small limit
- /loop: redirects to itself; /pingpong/a and /pingpong/b: redirect to each other
- /to/<host>/<path>: redirects to http://<host>/<path> (another host, or a malformed URL)
- /html: a web page instead of an image; /html-then/<name>: that page on the first request of <name>,
  the image after
- /slow-hops/<n>/<name>: n redirects of 0.3 s each, then the image
- /slow/<name>: the image after 0.3 s; /slow-headers/<name>: the status line at once, then the headers
  one byte every 0.1 s (about 5 s), then the image
It counts requests per path, remembers each request's User-Agent, and the most requests in flight at once.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

PAGE = b"<html><body>Not an image</body></html>"  # what /html serves


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a client that gave up mid-response (a timeout, a size cap) is what these paths test


class InFlight:
    """Requests being handled at once (`now`), and the most there were at once (`most`)."""

    def __init__(self):
        self.now = 0
        self.most = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def counting(self):
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            yield
        finally:
            with self._lock:
                self.now -= 1


class LoopbackServer:
    def __init__(self):
        self.images: dict[str, bytes] = {}
        self.requests: collections.Counter = collections.Counter()
        self.user_agents: list[str] = []
        # /slow/ requests waiting at once (counted until their response starts: a client can only send its
        # next request once it has the response, so the count never overlaps a client's two requests)
        self._waiting = InFlight()
        self._lock = threading.Lock()
        self.httpd = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def url(self, path: str) -> str:
        return self.base + path

    def add_image(self, name: str, data: bytes) -> str:
        self.images[name] = data
        return self.url(f"/img/{name}")

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _enter(self, path: str, user_agent: str) -> None:
        with self._lock:
            self.requests[path] += 1
            self.user_agents.append(user_agent)

    @property
    def most_in_flight(self) -> int:
        return self._waiting.most

    def waiting(self):
        return self._waiting.counting()


def _handler(server: LoopbackServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            server._enter(self.path, self.headers.get("User-Agent", ""))
            # the client gave up (a timeout or a size limit): what these paths test
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._route(self.path.strip("/").split("/"))

        def _route(self, parts: list[str]) -> None:
            head = parts[0]
            if head == "img":
                data = server.images.get(parts[1])
                return self._send(200, data, "image/png") if data is not None else self._send(404, b"no")
            if head == "redirect":
                return self._redirect(f"/img/{parts[1]}")
            if head == "slow-hops":  # /slow-hops/<n>/<name>: 0.3 s, then a redirect, n times; then the image
                time.sleep(0.3)
                hops = int(parts[1])
                return self._redirect(f"/slow-hops/{hops - 1}/{parts[2]}" if hops else f"/img/{parts[2]}")
            if head == "slow":
                with server.waiting():
                    time.sleep(0.3)
                return self._send(200, server.images[parts[1]], "image/png")
            if head == "status":
                return self._send(int(parts[1]), b"status")
            if head == "flaky":
                code, failures = int(parts[1]), int(parts[2])
                if server.requests[self.path] <= failures:
                    extra = {"Retry-After": "0"} if code == 429 else {}
                    return self._send(code, b"try again", headers=extra)
                return self._send(200, server.images["flaky"], "image/png")
            if head == "loop":
                return self._redirect("/loop")
            if head == "pingpong":
                return self._redirect("/pingpong/b" if parts[1] == "a" else "/pingpong/a")
            if head == "to":
                return self._redirect(f"http://{unquote(parts[1])}/{'/'.join(parts[2:])}")
            if head == "html" or (head == "html-then" and server.requests[self.path] == 1):
                return self._send(200, PAGE, "text/html")
            if head == "html-then":
                return self._send(200, server.images[parts[1]], "image/png")
            if head == "slow-headers":
                return self._slow_headers(server.images[parts[1]])
            if head == "big":
                self.send_response(200)
                self.send_header("Content-Length", str(10**9))
                self.end_headers()
                return None
            if head == "stall":
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.flush()
                time.sleep(5)
                return None
            if head in ("trickle", "endless"):
                return self._stream(head)
            return self._send(404, b"unknown path")

        def _stream(self, kind: str) -> None:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"x" if kind == "trickle" else b"\0" * 65536
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                if kind == "trickle":
                    time.sleep(0.1)

        def _slow_headers(self, body: bytes) -> None:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            self.wfile.flush()
            for byte in b"Content-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(body):
                time.sleep(0.1)
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            self.wfile.write(body)

        def _redirect(self, location: str) -> None:
            self._send(302, b"", headers={"Location": location})

        def _send(self, code: int, body: bytes, kind: str = "text/plain", headers: dict | None = None):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    return Handler
