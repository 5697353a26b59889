"""`codecage serve --http` past its connection cap: every connection turned away gets an
answer that says when to retry (`503` + `Retry-After`), never a bare reset.

Before the fix, a connection over the cap (or the idle one evicted for it) was closed with
the client's request unread: the kernel then resets the connection, and the `503` written
just before is lost with it. 1000 SDK clients at once: 744 got `ReadError` and no answer.
Raw sockets here, no sandbox runs (`--no-pool`): a few seconds.
"""

from __future__ import annotations

import socket
from pathlib import Path

from codecage.mcp import http as http_serving
from reliability import _load as load

CONNECTIONS = http_serving.MAX_CONNECTIONS + 172  # 172 turned away, or evicted for a new one


def status_and_retry(sock: socket.socket) -> tuple[str, str | None]:
    """The response's status line and its Retry-After, or what came instead of them."""
    received = b""
    try:
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                return f"closed after {received[:60]!r}", None
            received += chunk
    except OSError as exc:
        return f"{type(exc).__name__} after {received[:60]!r}", None
    head = received.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
    return head[0], headers.get("retry-after")


def test_connections_over_the_cap_all_get_an_answer_saying_when_to_retry(
    tmp_path: Path,
) -> None:
    with load.serving_http(tmp_path, "--no-pool") as server:
        port = int(server.url.split(":")[2].split("/")[0])
        socks = [
            socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(CONNECTIONS)
        ]
        try:
            for sock in socks:  # sent only once every connection is open: most were evicted
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answers = [status_and_retry(sock) for sock in socks]
        finally:
            for sock in socks:
                sock.close()
    served = [a for a in answers if a[0].startswith("HTTP/1.1 200")]
    told = [a for a in answers if a[0].startswith("HTTP/1.1 503") and a[1] == "1"]
    others = [a for a in answers if a not in served and a not in told]
    assert not others, f"{len(others)} of {CONNECTIONS} got no usable answer, e.g. {others[:3]}"
    assert served and told, (len(served), len(told))
