"""The sandbox's side of egress: a relay from 127.0.0.1 to the host's proxy.

The sandbox has its own network namespace with nothing but loopback, so nothing it sends
leaves by itself. A run allowed network gets this relay: it listens on 127.0.0.1 at
`contract.EGRESS_RELAY_PORT` (where HTTP_PROXY and friends point), and joins each
connection to a new connection to the Unix socket bound at `contract.EGRESS_SOCKET`,
whose other end is the host's proxy. Every decision is the proxy's: this relay is plumbing
the code could replace with its own (it would gain nothing: the socket is the only way
out, and the proxy knows the run by it).

One daemon thread with a selector for every connection: no thread per connection
(RLIMIT_NPROC counts threads), nothing imported once the code runs. Standard library only.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
from typing import Any

_CHUNK = 64 * 1024
_BACKLOG = 128


class _Pair:
    """One relayed connection: the code's side and the proxy's, and what waits to be sent."""

    __slots__ = ("inner", "inner_done", "outer", "outer_done", "to_inner", "to_outer")

    def __init__(self, inner: socket.socket, outer: socket.socket) -> None:
        self.inner = inner
        self.outer = outer
        self.to_outer = b""
        self.to_inner = b""
        self.inner_done = False  # the code shut its side (EOF read)
        self.outer_done = False


class Relay:
    """Listen on 127.0.0.1:`port`; join each connection to `proxy_path`."""

    def __init__(self, port: int, proxy_path: str) -> None:
        self._path = proxy_path
        self._sel = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(_BACKLOG)
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._stop_read, self._stop_write = socket.socketpair()
        self._sel.register(self._stop_read, selectors.EVENT_READ, "stop")
        self._thread = threading.Thread(
            target=self._serve, name="codecage-egress-relay", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop relaying and close every socket (the sandbox never does: it ends instead)."""
        self._stop_write.send(b"x")
        self._thread.join()

    def _serve(self) -> None:
        try:
            while True:
                for key, events in self._sel.select():
                    if key.data == "stop":
                        return
                    if key.data is None:
                        self._accept()
                    else:
                        self._pump(key.data, key.fileobj, events)
        finally:
            self._close_all()

    def _close_all(self) -> None:
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
        self._stop_write.close()

    def _accept(self) -> None:
        try:
            inner, _ = self._listener.accept()
        except OSError:
            return
        outer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            outer.connect(self._path)
        except OSError:
            inner.close()
            outer.close()
            return
        inner.setblocking(False)
        outer.setblocking(False)
        pair = _Pair(inner, outer)
        self._sel.register(inner, selectors.EVENT_READ, pair)
        self._sel.register(outer, selectors.EVENT_READ, pair)

    def _pump(self, pair: _Pair, sock: Any, events: int) -> None:
        inward = sock is pair.outer  # bytes from the proxy go to the code
        if events & selectors.EVENT_WRITE:
            self._flush(pair, to_inner=not inward)
        if events & selectors.EVENT_READ and pair.inner.fileno() >= 0:
            self._read(pair, inward=inward)
        self._rearm(pair)

    def _read(self, pair: _Pair, *, inward: bool) -> None:
        source = pair.outer if inward else pair.inner
        try:
            data = source.recv(_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if inward:
            pair.to_inner += data
            pair.outer_done = pair.outer_done or not data
        else:
            pair.to_outer += data
            pair.inner_done = pair.inner_done or not data
        self._flush(pair, to_inner=inward)

    def _flush(self, pair: _Pair, *, to_inner: bool) -> None:
        target = pair.inner if to_inner else pair.outer
        pending = pair.to_inner if to_inner else pair.to_outer
        try:
            sent = target.send(pending) if pending else 0
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(pair)
            return
        if to_inner:
            pair.to_inner = pending[sent:]
        else:
            pair.to_outer = pending[sent:]

    def _rearm(self, pair: _Pair) -> None:
        """Read a side only while its data has somewhere to go (bounded buffers); wait to
        write while data is pending; half-close once a side ended and all of it went."""
        if pair.inner.fileno() < 0:
            return
        if pair.inner_done and not pair.to_outer:
            _shut(pair.outer)
        if pair.outer_done and not pair.to_inner:
            _shut(pair.inner)
        if pair.inner_done and pair.outer_done and not pair.to_inner and not pair.to_outer:
            self._close(pair)
            return
        inner_reads = not pair.inner_done and not pair.to_outer
        outer_reads = not pair.outer_done and not pair.to_inner
        self._watch(pair.inner, pair, read=inner_reads, write=bool(pair.to_inner))
        self._watch(pair.outer, pair, read=outer_reads, write=bool(pair.to_outer))

    def _watch(self, sock: socket.socket, pair: _Pair, *, read: bool, write: bool) -> None:
        mask = (selectors.EVENT_READ if read else 0) | (selectors.EVENT_WRITE if write else 0)
        registered = _registered(self._sel, sock)
        if mask and registered:
            self._sel.modify(sock, mask, pair)
        elif mask:
            self._sel.register(sock, mask, pair)
        elif registered:
            self._sel.unregister(sock)

    def _close(self, pair: _Pair) -> None:
        for sock in (pair.inner, pair.outer):
            if _registered(self._sel, sock):
                self._sel.unregister(sock)
            sock.close()


def _registered(sel: selectors.BaseSelector, sock: socket.socket) -> bool:
    try:
        sel.get_key(sock)
    except (KeyError, ValueError):
        return False
    return True


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def start(port: int, proxy_path: str) -> Relay:
    """Bind the relay now (before the code runs: the port is ours) and serve on a thread."""
    relay = Relay(port, proxy_path)
    relay.start()
    return relay


def main(argv: list[str]) -> int:
    """`python -I -S relay.py PORT SOCKET`: for a sandbox that runs no codecage guest (a
    sandboxed upstream server). The port is bound before this returns: the process then
    forks, the child relays for the sandbox's life and the parent exits 0, so that a shell
    can start the server right after (`relay.py ... && exec server`)."""
    if len(argv) != 3 or not argv[1].isdigit():
        print("usage: relay.py PORT SOCKET", file=sys.stderr)
        return 2
    relay = Relay(int(argv[1]), argv[2])
    if os.fork() == 0:
        relay._serve()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
