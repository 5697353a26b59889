"""`codecage audit web`: a read-only web view of a SQLite audit store, made of Datasette.

Datasette (the `web` extra) serves the store opened `mode=ro` (it can neither write nor lock
it; the host's trail keeps writing beside it), with codecage's metadata: a title, canned
queries an operator wants first (recent runs, failures, denials by kind, tool calls, runs and
failures per hour over the last week) and charts of the latter drawn by datasette-vega, whose
JavaScript is bundled in the package: the page needs no network. `audit_meta` is hidden.

It binds to loopback by default, and then answers only requests whose Host is a loopback
name (a page that rebinds its own name to 127.0.0.1 cannot read it through the operator's
browser). Any other address needs a token (`--token-env VAR`): each request must carry it, as
HTTP Basic's password (what a browser prompts for) or a Bearer token; it is compared in
constant time, never logged, and taken off the request before Datasette sees it. A
PostgreSQL store has no web view here: point Grafana or Metabase at its tables.
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from codecage.audit.views import DENIAL_KINDS
from codecage.errors import ConfigError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_RUN_COLUMNS = (
    "x.started_at, x.execution_id, x.caller_kind || ':' || x.caller_name AS caller, "
    "x.status, x.wall_ms, x.backend, x.profile, "
    "(SELECT group_concat(kind, ', ') FROM events e WHERE e.execution_id = x.execution_id) "
    "AS events"
)
_DENIALS = ", ".join(f"'{kind}'" for kind in DENIAL_KINDS)

QUERIES: dict[str, dict[str, str]] = {
    "recent_runs": {
        "title": "Recent runs",
        "sql": f"SELECT {_RUN_COLUMNS} FROM executions x "  # noqa: S608 - constants only
        "ORDER BY x.started_at DESC LIMIT 200",
    },
    "failures": {
        "title": "Runs that did not succeed",
        "sql": f"SELECT {_RUN_COLUMNS} FROM executions x WHERE x.status != 'ok' "  # noqa: S608
        "ORDER BY x.started_at DESC LIMIT 200",
    },
    "denials": {
        "title": "Denials by kind",
        "sql": "SELECT e.kind, count(*) AS denials, count(DISTINCT x.caller_name) AS callers, "  # noqa: S608
        "max(x.started_at) AS last FROM events e JOIN executions x "
        f"ON x.execution_id = e.execution_id WHERE e.kind IN ({_DENIALS}) "
        "GROUP BY e.kind ORDER BY denials DESC",
    },
    "tool_calls": {
        "title": "Tool calls",
        "sql": "SELECT server || '.' || tool AS tool, count(*) AS calls, "
        "sum(status != 'ok') AS errors, round(avg(duration_ms)) AS mean_ms "
        "FROM tool_calls GROUP BY 1 ORDER BY calls DESC",
    },
    "runs_per_hour": {
        "title": "Runs and failures per hour, last 7 days",
        "sql": "SELECT substr(started_at, 1, 13) || ':00' AS hour, count(*) AS runs, "
        "sum(status != 'ok') AS failures FROM executions "
        "WHERE started_at >= strftime('%Y-%m-%dT%H:%M:%S', 'now', '-7 days') "
        "GROUP BY hour ORDER BY hour",
    },
}

CHART_FRAGMENT = (
    "#g.mark=bar&g.x_column=hour&g.x_type=ordinal&g.y_column=runs&g.y_type=quantitative"
    "&g.color_column=failures&g.color_type=quantitative"
)
"""datasette-vega's chart of runs_per_hour (its settings live in the URL's fragment)."""


def metadata(database: str) -> dict[str, Any]:
    """Datasette's metadata for the store served as `database` (its file's stem)."""
    chart = f"/{database}/runs_per_hour{CHART_FRAGMENT}"
    return {
        "title": "codecage audit trail",
        "description_html": (
            "Every execution on record (read-only). Start with "
            f'<a href="/{database}/recent_runs">recent runs</a>, '
            f'<a href="/{database}/failures">failures</a>, '
            f'<a href="/{database}/denials">denials</a>, '
            f'<a href="/{database}/tool_calls">tool calls</a>, or the '
            f'<a href="{chart}">chart of runs per hour</a>.'
        ),
        "databases": {
            database: {
                "queries": QUERIES,
                "tables": {"audit_meta": {"hidden": True}},
            }
        },
    }


def check_bind(host: str, token: str | None) -> None:
    """Loopback, or a token.

    Raises:
        ConfigError: another address without a token.
    """
    if token:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"the audit web view on {host} would show every run to whoever reaches it",
            hint="keep --host 127.0.0.1, or pass --token-env VAR naming a variable that "
            "holds a token",
        )


def app(store: Path, token: str | None) -> ASGIApp:
    """The Datasette app over `store` (read-only), behind the token when there is one.

    Raises:
        ConfigError: Datasette is not installed, or the store is not a SQLite file.
    """
    try:
        from datasette.app import Datasette  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ConfigError(
            f"the audit web view needs Datasette: {exc}",
            hint="pip install 'codecage[web]' (datasette, datasette-vega)",
        ) from exc
    if not store.is_file():
        raise ConfigError(f"there is no audit store at {store}", hint="pass --store PATH")
    datasette = Datasette(
        files=[str(store)],
        metadata=metadata(store.stem),
        settings={"allow_download": False, "allow_csv_stream": False},
    )
    asgi: ASGIApp = datasette.app()
    return _guarded(asgi, token)


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})


def _guarded(inner: ASGIApp, token: str | None) -> ASGIApp:
    """What reaches Datasette. With a token: only requests that carry it (401 otherwise),
    and without their Authorization header (Datasette's error pages print a request's
    headers). Without one (a loopback view): only requests whose Host is a loopback name,
    so a web page that rebinds its own name to 127.0.0.1 (DNS rebinding) cannot read the
    trail through the operator's browser (403 otherwise)."""
    expected = token.encode() if token else None

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await inner(scope, receive, send)
            return
        headers = list(scope.get("headers", []))
        if expected is not None:
            status = None if _carries(scope, expected) else 401
        else:
            status = None if _loopback_host(headers) else 403
        if status is None:
            kept = [(k, v) for k, v in headers if bytes(k).lower() != b"authorization"]
            await inner({**scope, "headers": kept}, receive, send)
        elif scope["type"] == "http":
            await _refuse(send, status)
        else:  # a websocket (Datasette has none)
            await send({"type": "websocket.close", "code": 1008})

    return guarded


def _loopback_host(headers: list[tuple[bytes, bytes]]) -> bool:
    host = next((bytes(v) for k, v in headers if bytes(k).lower() == b"host"), b"")
    name = host.decode("latin-1").lower()
    if name.rpartition(":")[2].isdigit():
        name = name.rpartition(":")[0]
    return name in LOOPBACK_NAMES


async def _refuse(send: Send, status: int) -> None:
    headers = [(b"content-type", b"text/plain")]
    if status == 401:  # a browser then asks for a login
        headers.append((b"www-authenticate", b'Basic realm="codecage audit"'))
    body = {
        401: b"a token is needed: Authorization: Bearer TOKEN (or Basic, TOKEN as password)\n",
        403: b"this view answers only to a loopback name (127.0.0.1, localhost)\n",
    }[status]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _carries(scope: Scope, expected: bytes) -> bool:
    """Whether the request's Authorization holds the token (Bearer, or Basic's password)."""
    for name, value in scope.get("headers", []):
        if name.lower() != b"authorization":
            continue
        kind, _, credential = bytes(value).partition(b" ")
        given = credential.strip()
        if kind.lower() == b"basic":
            try:
                given = base64.b64decode(given, validate=True).partition(b":")[2]
            except ValueError:
                return False
        elif kind.lower() != b"bearer":
            return False
        return hmac.compare_digest(given, expected)
    return False
