"""The driver's page server: the live page, its event stream, ``/metrics`` and a JSON snapshot.

One server per driver process and address (stdlib ``ThreadingHTTPServer`` in a daemon thread), shared by the
jobs the process runs: a new job's board replaces the last one, and the page follows it. It stays up after
a job ends, until the process exits (then open pages get the final state first: :meth:`Dashboard.drain`).

Every request must carry the server's random token (``?token=`` in the URL, or ``Authorization: Bearer``;
compared in constant time); anything else gets 403 and nothing of the job. It listens on 127.0.0.1 unless
asked otherwise. The page is one HTML file with its script and style inlined from this package (no CDN, no
other request). At most :data:`MAX_STREAMS` pages stream at once (more get 503); each stream sends the
board when it changed, at most every :data:`PUSH_S`, and a heartbeat every second otherwise.
"""

from __future__ import annotations

import atexit
import hmac
import secrets
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from phalanx.errors import InvalidArgumentError
from phalanx.observe import metrics
from phalanx.observe.board import JobBoard

MAX_STREAMS = 16
PUSH_S = 0.5
HEARTBEAT_S = 1.0
#: Seconds the driver waits at exit for open pages to receive the final state.
DRAIN_S = 2.0
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; connect-src 'self'; img-src 'self' data:; "
                               "style-src 'unsafe-inline'; script-src 'unsafe-inline'; frame-ancestors 'none'",
}


def page_html() -> bytes:
    """The page: ``index.html`` with ``style.css`` and ``app.js`` inlined (all shipped in this package)."""
    static = resources.files("phalanx.observe") / "static"
    html = (static / "index.html").read_text(encoding="utf-8")
    html = html.replace("/*STYLE*/", (static / "style.css").read_text(encoding="utf-8"))
    return html.replace("/*SCRIPT*/", (static / "app.js").read_text(encoding="utf-8")).encode()


class Dashboard:
    """A running page server; see the module docstring. Use :func:`dashboard_for` to get one."""

    def __init__(self, host: str, port: int) -> None:
        self.token = secrets.token_urlsafe(24)
        self.board: JobBoard | None = None
        self._page = page_html()
        self._streams = threading.BoundedSemaphore(MAX_STREAMS)
        self._sent: dict[int, int] = {}
        self._cond = threading.Condition()
        self.closed = False
        try:
            self._httpd = ThreadingHTTPServer((host, port), _Handler)
        except OSError as e:
            raise InvalidArgumentError(f"the job page cannot listen on {host}:{port}: {e}; give another port "
                                       "(0: a free one)") from e
        self._httpd.daemon_threads = True
        self._httpd.dashboard = self  # type: ignore[attr-defined]
        self.host, self.port = host, int(self._httpd.server_address[1])
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                         name="phalanx-dashboard", daemon=True).start()

    @property
    def url(self) -> str:
        """The page's address, token included."""
        shown = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        shown = f"[{shown}]" if ":" in shown else shown
        return f"http://{shown}:{self.port}/?token={self.token}"

    def show(self, board: JobBoard) -> None:
        """Make ``board`` (a new job's) the one the page shows."""
        self.board = board

    def allowed(self, given: str) -> bool:
        """Whether ``given`` is the token (constant time)."""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def page(self) -> bytes:
        """The page's HTML."""
        return self._page

    def stream_slot(self) -> bool:
        """Take one of the :data:`MAX_STREAMS` stream slots; False when all are taken."""
        return self._streams.acquire(blocking=False)

    def stream_sent(self, key: int, version: int | None) -> None:
        """Stream ``key`` has sent ``version`` of the board (None: the stream ended)."""
        with self._cond:
            if version is None:
                self._sent.pop(key, None)
                self._streams.release()
            else:
                self._sent[key] = version
            self._cond.notify_all()

    def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Wait (at most ``timeout_s``) until every open page has been sent the board's latest version."""
        board = self.board
        if board is None:
            return
        with self._cond:
            self._cond.wait_for(lambda: all(v >= board.version for v in self._sent.values()), timeout_s)

    def close(self) -> None:
        """Stop serving (streams end within :data:`PUSH_S`)."""
        self.closed = True
        self._httpd.shutdown()
        self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    server_version = "phalanx"
    protocol_version = "HTTP/1.1"

    @property
    def dashboard(self) -> Dashboard:
        return self.server.dashboard  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # the job's console is not the server's log
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if not self._authorized(url.query):
            self._send(HTTPStatus.FORBIDDEN, b"forbidden: this page needs the token printed by the driver\n")
            return
        route = {"/": self._page, "/events": self._events, "/snapshot": self._snapshot,
                 "/metrics": self._metrics}.get(url.path)
        if route is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n")
            return
        route()

    def _authorized(self, query: str) -> bool:
        given = parse_qs(query).get("token", [""])[0]
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[len("Bearer "):].strip()
        return self.dashboard.allowed(given)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in _HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _page(self) -> None:
        self._send(HTTPStatus.OK, self.dashboard.page(), "text/html; charset=utf-8")

    def _snapshot(self) -> None:
        board = self.dashboard.board
        body = board.json()[1] if board is not None else b"null"
        self._send(HTTPStatus.OK, body, "application/json")

    def _metrics(self) -> None:
        board = self.dashboard.board
        if board is None:
            self._send(HTTPStatus.OK, b"", metrics.CONTENT_TYPE)
            return
        try:
            body = metrics.render(board.snapshot)
        except ImportError:
            self._send(HTTPStatus.NOT_IMPLEMENTED, metrics.MISSING.encode())
            return
        self._send(HTTPStatus.OK, body, metrics.CONTENT_TYPE)

    def _events(self) -> None:
        dash = self.dashboard
        if not dash.stream_slot():
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, b"too many open pages; close one\n")
            return
        self.close_connection = True
        key = id(self)
        try:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            for name, value in _HEADERS.items():
                self.send_header(name, value)
            self.end_headers()
            self._stream(dash, key)
        except OSError:  # the page went away
            pass
        finally:
            dash.stream_sent(key, None)

    def _stream(self, dash: Dashboard, key: int) -> None:
        sent, board_sent, beat = -1, None, 0.0
        while not dash.closed:
            board, now = dash.board, time.monotonic()
            if board is not None:
                version, body = board.json()
                if version != sent or board is not board_sent:
                    self.wfile.write(b"data: " + body + b"\n\n")
                    self.wfile.flush()
                    sent, board_sent, beat = version, board, now
                    dash.stream_sent(key, version)
            if now - beat >= HEARTBEAT_S:
                self.wfile.write(b": alive\n\n")
                self.wfile.flush()
                beat = now
            time.sleep(PUSH_S)


_LOCK = threading.Lock()
_SERVERS: dict[str, Dashboard] = {}


def dashboard_for(host: str, port: int) -> tuple[Dashboard, bool]:
    """This process's server on ``host`` (on ``port``; 0: whichever it has); ``(server, new)``.

    Raises:
        InvalidArgumentError: the address cannot be listened on (in use, not this machine's).
    """
    with _LOCK:
        known = _SERVERS.get(host)
        if known is not None and port in (0, known.port):
            return known, False
        if known is not None:
            known.close()
        server = _SERVERS[host] = Dashboard(host, port)
        if len(_SERVERS) == 1:
            atexit.register(_drain_all)
        return server, True


def _drain_all() -> None:
    for server in list(_SERVERS.values()):
        server.drain()


def announce(server: Dashboard) -> None:
    """Print the page's address, once per job, where the user looks (the driver's stderr)."""
    sys.stderr.write(f"phalanx: job page at {server.url}\n")
    sys.stderr.flush()
