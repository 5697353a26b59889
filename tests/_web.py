"""Local HTTP servers the tests reach (through the egress proxy or straight): each on a free
loopback port, served from a daemon thread, logging nothing to the test's output."""

from __future__ import annotations

import contextlib
import http.server
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A request handler that logs nothing; `reply` answers 200 with a body."""

    def reply(self, body: bytes, content_type: str | None = None) -> None:
        self.send_response(200)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def start_http(
    handler: Callable[..., http.server.BaseHTTPRequestHandler],
    tls: ssl.SSLContext | None = None,
) -> http.server.ThreadingHTTPServer:
    """`handler` served on 127.0.0.1 (a free port), over TLS with `tls`; stop it with
    `shutdown()` and `server_close()`, or use `serving_http_on_loopback`."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@contextlib.contextmanager
def serving_http_on_loopback(
    handler: Callable[..., http.server.BaseHTTPRequestHandler],
    tls: ssl.SSLContext | None = None,
) -> Iterator[http.server.ThreadingHTTPServer]:
    """`start_http` for the length of a `with`."""
    httpd = start_http(handler, tls)
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
