"""What the egress proxy adds: one allowed HTTP GET through it vs straight from the host, and
connections per second through one proxy.

A local HTTP server on 127.0.0.1 answers a small body. Each pair is one GET direct (TCP to
the server) and one through the proxy (a run's Unix socket, absolute-form GET, the name
through the static resolver table), interleaved so that machine drift hits both alike, in
two modes: spaced (a pause between pairs: an idle host) and back to back. Then as many
GETs as fit in a few seconds through the proxy from several threads: connections/s.
Prints a table; writes nothing (the lead records results).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_egress.py -n 300
"""

from __future__ import annotations

import argparse
import http.server
import json
import shutil
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from codecage.egress.proxy import EgressProxy, RunEgress
from codecage.egress.resolve import Resolver
from codecage.egress.rules import EgressPolicy, parse_rules
from codecage.models.settings import NetworkLimits


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b"ok" * 64
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


def _exchange(sock: socket.socket, request: bytes) -> None:
    with sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    if not reply.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"unexpected reply: {reply[:200]!r}")


def direct(port: int) -> float:
    start = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", port))
    _exchange(sock, b"GET /x HTTP/1.1\r\nHost: api.bench\r\nConnection: close\r\n\r\n")
    return time.perf_counter() - start


def proxied(run: RunEgress, port: int) -> float:
    start = time.perf_counter()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(run.path))
    request = f"GET http://api.bench:{port}/x HTTP/1.1\r\nHost: api.bench\r\n\r\n"
    _exchange(sock, request.encode())
    return time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def pairs(run: RunEgress, port: int, n: int, pause_s: float) -> tuple[list[float], list[float]]:
    """n GETs each way, alternating which goes first; (direct, proxied) durations in s."""
    plain: list[float] = []
    through: list[float] = []
    for i in range(n):
        steps = [("direct", plain), ("proxied", through)]
        for kind, into in steps if i % 2 else reversed(steps):
            into.append(direct(port) if kind == "direct" else proxied(run, port))
            if pause_s:
                time.sleep(pause_s)
    return plain, through


def throughput(run: RunEgress, port: int, seconds: float, workers: int) -> float:
    stop = time.monotonic() + seconds
    counts = [0] * workers

    def work(index: int) -> None:
        while time.monotonic() < stop:
            proxied(run, port)
            counts[index] += 1

    started = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(work, range(workers)))
    return sum(counts) / (time.monotonic() - started)


_IN_SANDBOX = """
import json, socket, time
def get(request):
    start = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", {relay}))
    with sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    return time.perf_counter() - start
request = b"GET http://api.bench:{port}/x HTTP/1.1\\r\\nHost: api.bench\\r\\n\\r\\n"
for _ in range(20):
    get(request)
print(json.dumps([get(request) for _ in range({n})]))
"""


def from_a_sandbox(port: int, n: int, config: Path) -> tuple[list[float], list[float]]:
    """n GETs from code in a real sandbox (its relay, then the proxy), back to back, and n
    direct from the host right after: (direct, from the sandbox) durations in s."""
    from codecage import Options, Sandbox
    from codecage.guest import contract

    code = _IN_SANDBOX.format(relay=contract.EGRESS_RELAY_PORT, port=port, n=n)
    hosts = [f"api.bench:{port}", f"127.0.0.1:{port}"]
    with Sandbox(
        config=config, allow_hosts=hosts, options=Options(import_policy=False, scrub=False)
    ) as sb:
        r = sb.run(code, limits={"timeout": 120})
    if r.status != "ok":
        raise SystemExit(f"the sandboxed run failed: {r.stderr[-1000:]}")
    inside = [float(v) for v in json.loads(r.stdout.splitlines()[-1])]
    return [direct(port) for _ in range(n)], inside


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=200, help="pairs per mode")
    parser.add_argument("--seconds", type=float, default=3.0, help="throughput run length")
    parser.add_argument("--workers", type=int, default=4, help="throughput client threads")
    args = parser.parse_args()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    tmp = Path(tempfile.mkdtemp(prefix="cc-bench-egress-"))
    proxy = EgressProxy(Resolver({"api.bench": ["127.0.0.1"]}))
    try:
        run = proxy.listen(tmp / "run.sock")
        allow = parse_rules([f"api.bench:{port}", f"127.0.0.1:{port}"])
        run.grant(EgressPolicy(allow=allow), NetworkLimits(requests_per_second=100_000))
        pairs(run, port, 20, 0)  # warm up both paths
        rows = []
        for mode, pause_s in (("spaced", 0.01), ("back to back", 0.0)):
            plain, through = pairs(run, port, args.n, pause_s)
            added = [t - p for p, t in zip(plain, through, strict=True)]
            rows.append((mode, plain, through, added))
        rate = throughput(run, port, args.seconds, args.workers)
        run.grant(EgressPolicy(allow=allow), NetworkLimits())  # records afresh (bounded)
        config = tmp / "config.toml"
        config.write_text(
            '[network.resolve]\n"api.bench" = ["127.0.0.1"]\n'
            "[network.limits]\nrequests_per_second = 100000\n"
        )
        plain, inside = from_a_sandbox(port, args.n, config)
        rows.append(
            ("sandbox b2b", plain, inside, [i - p for p, i in zip(plain, inside, strict=True)])
        )
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{'mode':<14}{'direct p50':>12}{'p95':>8}{'proxy p50':>12}{'p95':>8}"
          f"{'added p50':>12}{'p95':>8}   (ms, n={args.n})")  # fmt: skip
    for mode, plain, through, added in rows:
        print(
            f"{mode:<14}{_pct(plain, 0.5):>12.3f}{_pct(plain, 0.95):>8.3f}"
            f"{_pct(through, 0.5):>12.3f}{_pct(through, 0.95):>8.3f}"
            f"{statistics.median(added) * 1000:>12.3f}{_pct(added, 0.95):>8.3f}"
        )
    print(f"connections/s through one proxy ({args.workers} client threads): {rate:.0f}")
    print(
        "spaced / back to back: a host client over the run's Unix socket; sandbox b2b: code "
        "in a sandbox through its relay and the proxy, then direct GETs from the host"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
