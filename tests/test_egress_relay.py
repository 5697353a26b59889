"""The sandbox's relay (guest/relay.py), on the host: bytes both ways, half-closes kept,
many connections on one thread, and nothing relayed when the proxy's socket is gone."""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from codecage.guest import relay


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _UnixEcho:
    """A Unix socket server that answers each connection with what it read, upper-cased,
    once the client shut its side (so the half-close must pass through the relay)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(64)
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            conn.sendall(data.upper())


@pytest.fixture
def relayed(tmp_path: Path) -> Iterator[tuple[int, _UnixEcho]]:
    path = tmp_path / "egress.sock"
    echo = _UnixEcho(path)
    port = _free_port()
    running = relay.start(port, str(path))
    yield port, echo
    running.close()
    echo.sock.close()


def _exchange(port: int, payload: bytes) -> bytes:
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        try:
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(65536):
                answer += chunk
        except OSError as exc:
            # Closed with our bytes unread (a reset), or before our half-close got there
            # (ENOTCONN, EPIPE: seen on a busy machine): nothing relayed either way.
            if exc.errno not in (errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE):
                raise
    return answer


def test_bytes_pass_both_ways_with_the_half_close(relayed: tuple[int, _UnixEcho]) -> None:
    port, echo = relayed
    assert _exchange(port, b"hello proxy") == b"HELLO PROXY"
    assert echo.connections == 1


def test_a_large_transfer_is_relayed_whole(relayed: tuple[int, _UnixEcho]) -> None:
    port, _ = relayed
    payload = os.urandom(3 * 1024 * 1024).hex().encode()[: 3 * 1024 * 1024]
    assert _exchange(port, payload) == payload.upper()


def test_many_connections_at_once_on_one_relay(relayed: tuple[int, _UnixEcho]) -> None:
    port, echo = relayed
    answers: dict[int, bytes] = {}

    def one(i: int) -> None:
        answers[i] = _exchange(port, f"connection {i}".encode())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert answers == {i: f"CONNECTION {i}".encode() for i in range(20)}
    assert echo.connections == 20


def test_without_the_proxy_socket_a_connection_is_closed_at_once(tmp_path: Path) -> None:
    port = _free_port()
    running = relay.start(port, str(tmp_path / "absent.sock"))
    try:
        assert _exchange(port, b"anything") == b""
    finally:
        running.close()
