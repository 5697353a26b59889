"""`codecage audit web`: a read-only web view of a SQLite audit store, made of Datasette.

Datasette (the `web` extra) serves the store opened `mode=ro` (it can neither write nor lock
it; the host's trail keeps writing beside it), with codecage's metadata: a title, canned
queries an operator wants first (recent runs, failures, denials by kind, tool calls, runs and
failures per hour over the last week) and charts of the latter drawn by datasette-vega, whose
JavaScript is bundled in the package: the page needs no network. `audit_meta` is hidden.

Every request needs a token, on loopback too: the store is root-only (0600), and a view
that answered any local user would hand each of them SQL over the whole trail. The token comes
from `--token` / CODECAGE_AUDIT_WEB_TOKEN or `--token-env VAR`; without one, a fresh random
token is made and printed once, with a URL that carries it. A request carries it as HTTP
Basic's password (what a browser prompts for), as a Bearer token, in a cookie the view sets, or
once in the URL's `?token=` (answered with a redirect that sets the cookie, HttpOnly and
SameSite=Strict, and takes the token out of the address bar). It is compared in constant time,
never logged, and taken off the request before Datasette sees it. `--insecure-no-token` waives
it, on loopback only, as `codecage serve --http` does. On loopback the view also answers only
requests whose Host is a loopback name (a page that rebinds its own name to 127.0.0.1 cannot
read it through the operator's browser). A PostgreSQL store has no web view here: point
Grafana or Metabase at its tables.
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import secrets
import urllib.parse
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
        "title": "Denials by kind (host: observed; guest: the guest's claim)",
        "sql": "SELECT e.kind, coalesce(e.source, 'unknown') AS source, count(*) AS denials, "  # noqa: S608
        "count(DISTINCT x.caller_name) AS callers, "
        "max(x.started_at) AS last FROM events e JOIN executions x "
        f"ON x.execution_id = e.execution_id WHERE e.kind IN ({_DENIALS}) "
        "GROUP BY e.kind, e.source ORDER BY e.source = 'host' DESC, denials DESC",
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


TOKEN_COOKIE = "codecage_audit_token"  # noqa: S105 - a name, not a secret
"""The cookie a request with the right `?token=` gets, so a browser's next pages carry it."""
TOKEN_BYTES = 24
"""Random bytes of a token made when none is given (192 bits, 32 URL-safe characters)."""


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, *, insecure_no_token: bool = False) -> None:
    """A token, or its explicit waiver on loopback.

    Raises:
        ConfigError: no token on another address than loopback, or no token and no waiver.
    """
    if token:
        return
    if not is_loopback(host):
        raise ConfigError(
            f"the audit web view on {host} would show every run to whoever reaches it",
            hint="keep --host 127.0.0.1, or give a token: --token-env VAR naming a variable "
            "that holds one, or --token (CODECAGE_AUDIT_WEB_TOKEN)",
        )
    if not insecure_no_token:
        raise ConfigError(
            "refusing to serve the audit web view without a token: every local user of "
            "this machine could read the whole trail",
            hint="give a token (--token, CODECAGE_AUDIT_WEB_TOKEN, --token-env VAR), let "
            "codecage make one (the default), or --insecure-no-token to accept the risk",
        )


def new_token() -> str:
    """A fresh random token, for a view started without one."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def app(store: Path, token: str | None, *, loopback: bool = True) -> ASGIApp:
    """The Datasette app over `store` (read-only), behind the token when there is one
    (None: the operator waived it, on loopback), answering only loopback Host names when
    bound to `loopback`.

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
    return _guarded(asgi, token, loopback=loopback)


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})


def _guarded(inner: ASGIApp, token: str | None, *, loopback: bool) -> ASGIApp:
    """What reaches Datasette. With a token: only requests that carry it (401 otherwise),
    and without their Authorization and Cookie headers (Datasette's error pages print a
    request's headers). On loopback: only requests whose Host is a loopback name, so a web
    page that rebinds its own name to 127.0.0.1 (DNS rebinding) cannot read the trail
    through the operator's browser (403 otherwise)."""
    expected = token.encode() if token else None

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await inner(scope, receive, send)
            return
        headers = list(scope.get("headers", []))
        if loopback and not _loopback_host(headers):
            status: int | None = 403
        elif expected is None or _carries(scope, expected):
            status = None
        elif _in_query(scope, expected):
            if scope["type"] == "http":
                await _set_cookie(scope, send, expected)
                return
            status = None
        else:
            status = 401
        if status is None:
            secret = (b"authorization", b"cookie")
            kept = [(k, v) for k, v in headers if bytes(k).lower() not in secret]
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
    """Whether the request's Authorization (Bearer, or Basic's password) or its cookie holds
    the token."""
    for name, value in scope.get("headers", []):
        name = bytes(name).lower()
        if name == b"cookie" and _cookie_holds(bytes(value), expected):
            return True
        if name != b"authorization":
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


def _cookie_holds(header: bytes, expected: bytes) -> bool:
    for pair in header.split(b";"):
        name, _, value = pair.strip().partition(b"=")
        if name == TOKEN_COOKIE.encode() and hmac.compare_digest(value, expected):
            return True
    return False


def _in_query(scope: Scope, expected: bytes) -> bool:
    query = urllib.parse.parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
    return any(hmac.compare_digest(v.encode("latin-1"), expected) for v in query.get("token", []))


async def _set_cookie(scope: Scope, send: Send, expected: bytes) -> None:
    """The page asked for, without `token` in its address, with the token as a cookie."""
    query = urllib.parse.parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1"))
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "token"])
    location = urllib.parse.quote(str(scope.get("path", "/"))) + (f"?{rest}" if rest else "")
    cookie = (
        f"{TOKEN_COOKIE}={expected.decode('latin-1')}; Path=/; HttpOnly; SameSite=Strict"
    ).encode("latin-1")
    headers = [
        (b"location", location.encode("latin-1")),
        (b"set-cookie", cookie),
        (b"cache-control", b"no-store"),
        (b"referrer-policy", b"no-referrer"),
    ]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
