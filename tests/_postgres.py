"""A real PostgreSQL server for the tests: Debian's binaries, a cluster made with initdb in a
temporary directory, run by an unprivileged user (PostgreSQL refuses root), trust
authentication on loopback and its own Unix socket only, stopped and removed at the end.

`postgres_server` (session) starts one; `postgres_url` (per test) gives each test a new
database on it, dropped afterwards. The tests are skipped only when the binaries are not
installed (scripts/setup installs them).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

BIN_GLOB = "/usr/lib/postgresql/*/bin"
SERVER_USER = "postgres"  # made by Debian's package
START_TIMEOUT_S = 60

HBA = """\
# Trust, but only on this cluster's own socket directory and on loopback.
local all all trust
host all all 127.0.0.1/32 trust
host all all ::1/128 trust
"""


@dataclass
class PostgresServer:
    """A running cluster: its files (`data`), socket directory and loopback port."""

    bin: Path
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def sockets(self) -> Path:
        return self.root / "sockets"

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{SERVER_USER}{secret}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self._pg_ctl(
            "start",
            "-w",
            "-t",
            str(START_TIMEOUT_S),
            "-l",
            str(self.root / "log"),
            "-o",
            # No autovacuum: the tests vacuum through the store, and its ANALYZE would copy
            # values into pg_statistic, where the erasure test would find them. No fsync:
            # nothing here outlives the test run.
            f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 "
            "-c autovacuum=off -c fsync=off",
        )

    def stop(self) -> None:
        self._pg_ctl("stop", "-w", "-m", "fast")

    def admin(self, sql: str, database: str = "postgres") -> list[tuple[object, ...]]:
        """Run `sql` as the superuser, outside a transaction (CREATE DATABASE, CHECKPOINT)."""
        with psycopg.connect(self.url(database), autocommit=True) as db:
            cur = db.execute(sql.encode())
            return cur.fetchall() if cur.description else []

    def _pg_ctl(self, *args: str) -> None:
        command = [str(self.bin / "pg_ctl"), "-D", str(self.data), *args]
        subprocess.run(
            _as_server_user(command), check=True, capture_output=True, timeout=START_TIMEOUT_S + 30
        )


def _as_server_user(command: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root; CI and this machine run the tests as root.
    return ["runuser", "-u", SERVER_USER, "--", *command] if os.geteuid() == 0 else command


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    found = sorted(glob.glob(f"{BIN_GLOB}/initdb"))
    if not found:
        pytest.skip("PostgreSQL's binaries are not installed (scripts/setup installs them)")
    root = Path(tempfile.mkdtemp(prefix="codecage-pg-"))
    server = PostgresServer(bin=Path(found[-1]).parent, root=root, port=_free_port())
    try:
        server.sockets.mkdir()
        if os.geteuid() == 0:
            user = pwd.getpwnam(SERVER_USER)
            for path in (root, server.sockets):
                os.chown(path, user.pw_uid, user.pw_gid)
        subprocess.run(
            _as_server_user(
                [
                    str(server.bin / "initdb"),
                    "-D",
                    str(server.data),
                    "-U",
                    SERVER_USER,
                    "-A",
                    "trust",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )
        (server.data / "pg_hba.conf").write_text(HBA)
        server.start()
        try:
            yield server
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A new, empty database on the test server (its URL); dropped after the test."""
    name = f"audit_{uuid.uuid4().hex[:12]}"
    postgres_server.admin(f"CREATE DATABASE {name}")
    try:
        yield postgres_server.url(name)
    finally:
        postgres_server.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
