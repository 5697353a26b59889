"""Egress of sandboxed upstream MCP servers (`"sandbox": true` with `allow_hosts`): the same
proxy as a run's, one per Broker (made at the first such server), a socket per server
granted that server's hosts for its life. `[network] deny`, the limits and the credentials
at the edge hold as for runs; the connections are logged when the server stops, and kept
for `records` (the audit trail will take them)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from codecage.egress import setup as egress_setup
from codecage.egress.proxy import RunEgress
from codecage.egress.records import ConnectionRecord
from codecage.egress.rules import EgressPolicy
from codecage.isolation.identity import Identity
from codecage.models import NetworkSettings
from codecage.models.hosts import parse_rules

log = logging.getLogger(__name__)


class ServerEgress:
    """The egress of one Broker's sandboxed servers."""

    def __init__(self, settings: NetworkSettings, base_dir: Path | None = None) -> None:
        self.settings = settings
        self._base_dir = base_dir
        self._setup: egress_setup.EgressSetup | None = None
        self._records: dict[str, list[ConnectionRecord]] = {}
        self._lock = threading.Lock()

    def setup(self) -> egress_setup.EgressSetup:
        with self._lock:
            if self._setup is None:
                self._setup = egress_setup.build(self.settings, base_dir=self._base_dir)
            return self._setup

    def open(
        self, name: str, allow_hosts: tuple[str, ...], directory: Path, owner: Identity
    ) -> RunEgress:
        """Server `name`'s socket in `directory` (bound into its sandbox), granted its hosts;
        connectable by the sandbox's host id only.

        Raises:
            ConfigError: the proxy cannot be made (a credential cannot be read).
        """
        listener = self.setup().open_socket(directory, owner)
        policy = EgressPolicy(
            allow=parse_rules(allow_hosts, what=f"mcpServers.{name}.allow_hosts"),
            deny=parse_rules(self.settings.deny, what="[network] deny"),
        )
        listener.grant(policy, self.settings.limits)
        return listener

    def closed(self, name: str, listener: RunEgress) -> None:
        """Server `name` stopped: its connections logged and kept, its socket closed."""
        listener.revoke()
        found = listener.records()
        listener.close()
        with self._lock:
            self._records.setdefault(name, []).extend(found)
        for record in found:
            log.info(
                "egress.upstream_connection",
                extra={
                    "server": name,
                    "host": record.host,
                    "port": record.port,
                    "allowed": record.allowed,
                    "reason": record.reason,
                    "bytes_out": record.bytes_out,
                    "bytes_in": record.bytes_in,
                },
            )

    def records(self, name: str) -> list[ConnectionRecord]:
        """What server `name`'s sandboxes connected to so far (those that stopped)."""
        with self._lock:
            return list(self._records.get(name, []))

    def close(self) -> None:
        with self._lock:
            if self._setup is not None:
                self._setup.proxy.close()
                self._setup = None
