"""The console's HTTP side: the page, its JSON API and a server-sent event stream of
snapshots, served by the standard library's threading HTTP server.

Why the standard library and not an ASGI or aiohttp app: the console's work is blocking
calls through the synchronous client library, the pages it serves are three static files,
and its listeners are a handful of operators' browsers; a thread per connection fits that
exactly and adds no dependency to every `squall` installation.

    GET  /                         the page (static/index.html)
    GET  /static/NAME              its script and style sheet
    GET  /api/snapshot             the last snapshot (JSON)
    GET  /api/stream               server-sent events: one `snapshot` event per poll
    GET  /api/topics/NAME/events?from=N&count=M   recent events (default: the last 20)
    POST /api/topics/NAME/publish  {"payload", "encoding": text|hex, "key", "headers"}
    POST /api/actions              {"action", "node", "reason", "confirm": node}
    GET|POST /login, POST /logout  the token form (only when the console has a token)

With a token, every other request needs it: `Authorization: Bearer TOKEN`, or the cookie
the login form sets. POSTs must be JSON (a cross-site form cannot send that without the
browser asking first), so a page elsewhere cannot drive the console through the cookie.
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from importlib import resources
from typing import Any

from squall_server.console.backend import ConsoleBackend, ConsoleError

log = logging.getLogger("squall.console")

COOKIE_NAME = "squall_console"
# The largest request body the console reads: a hex payload of a 1 MiB event is 2 MiB;
# anything larger than this is refused before it is read.
BODY_MAX_BYTES = 8 * 1024 * 1024
# Seconds an idle event stream waits before a keep-alive comment (proxies close silent
# connections).
STREAM_KEEPALIVE_S = 15.0
_STATIC_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript"}
_STATIC_FILES = ("index.html", "console.css", "console.js", "login.html")


def _static(name: str) -> bytes:
    return resources.files("squall_server.console").joinpath("static", name).read_bytes()


class ConsoleServer(http.server.ThreadingHTTPServer):
    """The HTTP server: one thread per connection, the backend and the token shared."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        backend: ConsoleBackend,
        token: str | None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.backend = backend
        self.token = token
        self.secure = ssl_context is not None
        self.stopping = threading.Event()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, ConsoleHandler)
        if ssl_context is not None:
            self.socket = ssl_context.wrap_socket(self.socket, server_side=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{text}]" if ":" in text else text
        return f"{'https' if self.secure else 'http'}://{shown}:{port}/"

    def stop(self) -> None:
        """Ends the event streams, then the serving loop."""
        self.stopping.set()
        self.shutdown()
        self.server_close()


class ConsoleHandler(http.server.BaseHTTPRequestHandler):
    """One request: route, check the token, answer JSON, a file or an event stream."""

    server: ConsoleServer
    protocol_version = "HTTP/1.1"
    server_version = "squall-console"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # -- plumbing ---------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, document: dict[str, Any], **headers: str) -> None:
        body = json.dumps(document, separators=(",", ":")).encode("utf-8")
        self._send(status, body, "application/json", **headers)

    def _error(self, status: int, message: str, **headers: str) -> None:
        self._json(status, {"error": message, "status": status}, **headers)

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        header = self.headers.get("Authorization", "")
        if header.startswith("Bearer ") and hmac.compare_digest(
            header[len("Bearer ") :].strip().encode(), token.encode()
        ):
            return True
        for part in self.headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE_NAME and hmac.compare_digest(
                urllib.parse.unquote(value).encode(), token.encode()
            ):
                return True
        return False

    def _refuse_unauthorized(self, path: str) -> None:
        if path == "/" and self.command == "GET":
            self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", Location="/login")
            return
        self._error(
            HTTPStatus.UNAUTHORIZED,
            "this console needs its token: send 'Authorization: Bearer TOKEN' or log in at /login",
            WWW_Authenticate='Bearer realm="squall-console"',
        )

    def _body(self) -> bytes:
        length_text = self.headers.get("Content-Length", "0")
        try:
            length = int(length_text)
        except ValueError:
            raise ConsoleError(400, f"bad Content-Length {length_text!r}") from None
        if length > BODY_MAX_BYTES:
            self.close_connection = True  # the body stays unread
            raise ConsoleError(
                413, f"request body of {length} bytes is over the console's {BODY_MAX_BYTES}"
            )
        return self.rfile.read(length) if length > 0 else b""

    def _json_body(self) -> dict[str, Any]:
        if self.headers.get_content_type() != "application/json":
            raise ConsoleError(415, "send the request as application/json")
        try:
            document = json.loads(self._body() or b"{}")
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConsoleError(400, f"the request body is not JSON: {err}") from None
        if not isinstance(document, dict):
            raise ConsoleError(400, "the request body must be a JSON object")
        return document

    # -- routes -----------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch(self._get)

    def do_HEAD(self) -> None:
        self._dispatch(self._get)

    def do_POST(self) -> None:
        self._dispatch(self._post)

    def _dispatch(self, route: Callable[[str, dict[str, list[str]]], None]) -> None:
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        try:
            if path in ("/login", "/logout") or path.startswith("/static/"):
                route(path, query)
            elif not self._authorized():
                self._refuse_unauthorized(path)
            else:
                route(path, query)
        except ConsoleError as err:
            self._error(err.status, err.message)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception:  # a bug: say so on the page, keep serving
            log.exception("console request %s %s failed", self.command, self.path)
            self._error(500, "the console failed on this request; see its log")

    def _get(self, path: str, query: dict[str, list[str]]) -> None:
        backend = self.server.backend
        if path == "/":
            self._send(200, _static("index.html"), "text/html; charset=utf-8")
        elif path == "/login":
            self._send(200, _static("login.html"), "text/html; charset=utf-8")
        elif path.startswith("/static/"):
            name = path[len("/static/") :]
            if name not in _STATIC_FILES:
                raise ConsoleError(404, f"no file {name!r}")
            kind = _STATIC_TYPES[name[name.rindex(".") :]]
            self._send(200, _static(name), f"{kind}; charset=utf-8")
        elif path == "/api/snapshot":
            self._json(200, backend.snapshot()[1])
        elif path == "/api/stream":
            self._stream()
        elif path.startswith("/api/topics/") and path.endswith("/events"):
            name = urllib.parse.unquote(path[len("/api/topics/") : -len("/events")])
            start = query.get("from", [""])[0]
            count = query.get("count", [""])[0]
            self._json(200, backend.recent_events(name, start, count))
        else:
            raise ConsoleError(404, f"no page {path!r}")

    def _post(self, path: str, query: dict[str, list[str]]) -> None:
        backend = self.server.backend
        if path == "/login":
            self._login()
        elif path == "/logout":
            self._send(303, b"", "text/plain", Location="/login", Set_Cookie=self._cookie("", 0))
        elif path.startswith("/api/topics/") and path.endswith("/publish"):
            name = urllib.parse.unquote(path[len("/api/topics/") : -len("/publish")])
            body = self._json_body()
            self._json(200, backend.publish(name, body))
        elif path == "/api/actions":
            self._json(200, backend.action(self._json_body()))
        else:
            raise ConsoleError(404, f"no action {path!r}")

    def _cookie(self, value: str, max_age: int) -> str:
        secure = "; Secure" if self.server.secure else ""
        return (
            f"{COOKIE_NAME}={urllib.parse.quote(value)}; Path=/; HttpOnly; SameSite=Strict"
            f"; Max-Age={max_age}{secure}"
        )

    def _login(self) -> None:
        token = self.server.token
        if token is None:
            self._send(303, b"", "text/plain", Location="/")
            return
        form = urllib.parse.parse_qs(self._body().decode("utf-8", "replace"))
        given = form.get("token", [""])[0].strip()
        if given and hmac.compare_digest(given.encode(), token.encode()):
            # A session cookie lasting a working day; the token itself is what it holds,
            # so a restart with another token logs everyone out.
            self._send(303, b"", "text/plain", Location="/", Set_Cookie=self._cookie(given, 43200))
            return
        self._send(303, b"", "text/plain", Location="/login?failed=1")

    def _stream(self) -> None:
        """Server-sent events: the current snapshot, then each new one as it is polled."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        backend = self.server.backend
        version, snapshot = backend.snapshot()
        self._event(snapshot)
        # Ends when the server stops or the browser goes (the write fails).
        while not self.server.stopping.is_set():
            newer = backend.wait_newer(version, STREAM_KEEPALIVE_S)
            if newer is None:
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
                continue
            version, snapshot = newer
            self._event(snapshot)

    def _event(self, snapshot: dict[str, Any]) -> None:
        data = json.dumps(snapshot, separators=(",", ":"))
        self.wfile.write(f"event: snapshot\ndata: {data}\n\n".encode())
        self.wfile.flush()
