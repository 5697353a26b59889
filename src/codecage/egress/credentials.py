"""Credentials added at the edge: the sandbox holds a placeholder, the proxy the secret.

The operator declares, per host, a header and where its value comes from on the host:

```toml
[network.credentials."api.example.com"]
header = "Authorization"
env = "EXAMPLE_API_KEY"        # or: file = "/etc/codecage/example.key"
format = "Bearer {}"           # the header's value; {} is the secret
```

The key is an exact host (no wildcard), optionally with a port (`"api.example.com:8443"`);
without one it applies to every port the run may reach on that host. `CredentialStore.load`
reads every value on the host once, at start; a missing variable or file is a ConfigError.
No value is ever printed: not in errors, reprs or logs.

What the code sees: for each credential host it may reach, an environment variable
`CODECAGE_CREDENTIAL_<HOST>[_<PORT>]` holding a *placeholder*, `codecage-credential-<24
hex>`, derived from the host alone (stable across runs, nothing of the secret in it). The
code may put it where an SDK insists on a key; it is worth nothing anywhere else.

What the proxy does with a request to a credential host (`HostCredential.rewrite_headers`):

- The configured header is **always set** by the proxy to `format` with the secret in it:
  every copy the code sent (the placeholder, a real-looking key, anything) is removed and
  one header is put in the first one's place, or appended when the code sent none. The
  operator's declaration decides what the host receives; the code cannot choose the form.
- Nothing else is substituted: a placeholder in another header, the URL or the body is
  sent as it is. The secret goes to the place the operator named and nowhere else (a
  header such as Referer or User-Agent is logged and echoed by servers in forms a scrubber
  cannot recognise).
- `Accept-Encoding` is replaced by `identity`, so that a response echoing the secret
  arrives in a form the scrubber can read (not gzip).
- A request to another host is never given this host's secret: the proxy looks the
  credential up by the connection's host and port, never by anything in the request.

Responses from a credential host pass through `ResponseScrubber` (the body, streamed) and
`scrub_headers` (the head): each secret, and its base64 forms at the three alignments (so
a `Basic` header's or a JSON field's encoding is caught too), becomes `[CREDENTIAL]`.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from codecage.errors import ConfigError
from codecage.models.hosts import CONTROL, Credential

MARKER = b"[CREDENTIAL]"
PLACEHOLDER_PREFIX = "codecage-credential-"
ENV_PREFIX = "CODECAGE_CREDENTIAL_"
MIN_SECRET_BYTES = 8  # shorter, and the scrubber would blank ordinary text
_FILE_MAX_BYTES = 64 * 1024
_MIN_ENCODED = 8  # a base64 fragment shorter than this is too common to scrub
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")

Headers = list[tuple[bytes, bytes]]


Credentials = dict[str, Credential]
"""The config's `[network.credentials."HOST[:PORT]"]` tables, keyed by host."""


@dataclass(frozen=True, slots=True)
class HostCredential:
    """One host's resolved credential, as the proxy uses it. The secret never shows in its
    repr."""

    host: str
    port: int | None  # None: every port
    header: str
    placeholder: str
    env_name: str
    value: bytes = field(repr=False)  # the header's value: format with the secret in it
    secret: bytes = field(repr=False)

    @property
    def key(self) -> str:
        """The host as the config names it (normalised): HOST or HOST:PORT."""
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return shown if self.port is None else f"{shown}:{self.port}"

    def rewrite_headers(self, headers: Headers) -> Headers:
        """The request's headers for this host: the credential header set (every copy the
        code sent replaced by one), `Accept-Encoding: identity`; the rest as they are.

        Raises:
            Nothing.
        """
        name = self.header.lower().encode("ascii")
        out: Headers = []
        placed = False
        for key, value in headers:
            lowered = key.lower()
            if lowered == name:
                if not placed:
                    out.append((self.header.encode("ascii"), self.value))
                    placed = True
            elif lowered != b"accept-encoding":
                out.append((key, value))
        if not placed:
            out.append((self.header.encode("ascii"), self.value))
        out.append((b"Accept-Encoding", b"identity"))
        return out


class CredentialStore:
    """Every configured credential, resolved on the host (`load`), looked up by host."""

    def __init__(self, credentials: Iterable[HostCredential] = ()) -> None:
        self._by_key: dict[tuple[str, int | None], HostCredential] = {
            (c.host, c.port): c for c in credentials
        }
        self._forms = secret_forms(c.secret for c in self._by_key.values())

    def __repr__(self) -> str:
        return f"CredentialStore({sorted(c.key for c in self._by_key.values())})"

    def __len__(self) -> int:
        return len(self._by_key)

    @classmethod
    def load(
        cls,
        mapping: Mapping[str, Credential],
        environ: Mapping[str, str] | None = None,
        *,
        base_dir: Path | None = None,
    ) -> CredentialStore:
        """Resolve every credential of the config's `[network.credentials]` now, on the
        host: `environ` (default: this process's environment) for `env`, the files for
        `file` (relative to `base_dir`, the config file's directory).

        Raises:
            ConfigError: a host key is not an exact HOST[:PORT], two hosts share a variable
                name, a variable is unset or empty, a file is missing, not a regular file,
                empty or too big, or a value holds a line break or is too short to scrub.
        """
        env = os.environ if environ is None else environ
        resolved: list[HostCredential] = []
        names: dict[str, str] = {}
        for key, credential in mapping.items():
            host, port = parse_host_key(key)
            entry = _resolve(key, host, port, credential, env, base_dir)
            if entry.env_name in names:
                raise ConfigError(
                    f"[network.credentials]: {names[entry.env_name]!r} and {key!r} give the "
                    f"code the same variable {entry.env_name}",
                    hint="keep one of the two hosts' credentials",
                )
            names[entry.env_name] = key
            resolved.append(entry)
        return cls(resolved)

    def lookup(self, host: str, port: int) -> HostCredential | None:
        """The credential for a connection to `host`:`port` (HOST:PORT first, then HOST),
        or None: that host is tunnelled untouched."""
        name = _normal_name(host)
        return self._by_key.get((name, port)) or self._by_key.get((name, None))

    def rewrite_headers(self, host: str, port: int, headers: Headers) -> Headers:
        """`headers` of a request to `host`:`port` with its credential set
        (`HostCredential.rewrite_headers`); unchanged for a host without one.

        Raises:
            Nothing.
        """
        credential = self.lookup(host, port)
        return headers if credential is None else credential.rewrite_headers(headers)

    def environment(self, allowed: Callable[[str, int], bool]) -> dict[str, str]:
        """The sandbox's environment entries (name -> placeholder) for the credential hosts
        a run may reach: `allowed(host, port)` is the run's egress decision by name (for a
        credential without a port, reaching port 443 or 80 counts)."""
        out: dict[str, str] = {}
        for credential in self._by_key.values():
            ports = (443, 80) if credential.port is None else (credential.port,)
            if any(allowed(credential.host, port) for port in ports):
                out[credential.env_name] = credential.placeholder
        return dict(sorted(out.items()))

    def secrets(self) -> tuple[bytes, ...]:
        """Every secret, for a scrubber of something other than a response."""
        return tuple(c.secret for c in self._by_key.values())

    def response_scrubber(self) -> ResponseScrubber:
        """A fresh scrubber for one response body (every secret of the store)."""
        return ResponseScrubber(self._forms)

    def scrub_headers(self, headers: Headers) -> Headers:
        """A response's headers with every secret replaced (`scrub_headers`)."""
        return scrub_headers(headers, self._forms)

    def scrub(self, data: bytes) -> bytes:
        """`data` (whole) with every secret replaced by [CREDENTIAL]."""
        return self._forms.scrub(data)


def parse_host_key(key: str) -> tuple[str, int | None]:
    """A credential's key, `HOST` or `HOST:PORT` (`[IPv6]:PORT`), normalised.

    Raises:
        ConfigError: a wildcard, a URL, a bad name or port.
    """
    raw = key.strip()
    host, port_text = raw, ""
    if raw.startswith("["):
        host, _, rest = raw[1:].partition("]")
        port_text = rest.removeprefix(":") if rest.startswith(":") else rest
    elif raw.count(":") == 1:
        host, _, port_text = raw.partition(":")
    port = None
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise _key_error(key, "the port must be a number from 1 to 65535")
        port = int(port_text)
    name = _normal_name(host)
    try:
        return str(ipaddress.ip_address(name)), port
    except ValueError:
        pass
    labels = name.split(".")
    if "*" in name:
        raise _key_error(key, "a credential names one exact host, not a wildcard")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise _key_error(key, "write a host name or an IP address, optionally with :PORT")
    return name, port


def placeholder(host: str, port: int | None) -> str:
    """The stable placeholder for a credential host: derived from the host, not the
    secret, so the code learns nothing from it."""
    key = host if port is None else f"{host}:{port}"
    digest = hashlib.sha256(b"codecage-credential\0" + key.encode()).hexdigest()
    return PLACEHOLDER_PREFIX + digest[:24]


def environment_name(host: str, port: int | None) -> str:
    """`CODECAGE_CREDENTIAL_API_EXAMPLE_COM` (`_8443` appended for a port)."""
    stem = re.sub(r"[^A-Z0-9]", "_", host.upper())
    return ENV_PREFIX + stem + ("" if port is None else f"_{port}")


def _key_error(key: str, what: str) -> ConfigError:
    return ConfigError(
        f"[network.credentials.{key!r}]: {what}",
        hint='name the host as the code reaches it, e.g. [network.credentials."api.example.com"]',
    )


def _normal_name(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _resolve(
    key: str,
    host: str,
    port: int | None,
    credential: Credential,
    env: Mapping[str, str],
    base_dir: Path | None,
) -> HostCredential:
    where = f'[network.credentials."{key}"]'
    secret = (
        _from_env(where, credential.env, env)
        if credential.env is not None
        else _from_file(where, credential.file, base_dir)
    )
    if len(secret) < MIN_SECRET_BYTES or CONTROL.search(secret.decode("latin-1")):
        raise ConfigError(
            f"{where}: the secret is shorter than {MIN_SECRET_BYTES} bytes or holds a line "
            "break or other control character",
            hint="a credential must be one line of at least 8 characters; check its source "
            "(its value is not shown)",
        )
    value = credential.format.replace("{}", "\0").encode("utf-8").replace(b"\0", secret)
    return HostCredential(
        host=host,
        port=port,
        header=credential.header,
        placeholder=placeholder(host, port),
        env_name=environment_name(host, port),
        value=value,
        secret=secret,
    )


def _from_env(where: str, name: str | None, env: Mapping[str, str]) -> bytes:
    assert name is not None  # noqa: S101 - the model has one source
    value = env.get(name, "")
    if not value:
        raise ConfigError(
            f"{where}: the environment variable {name} is not set on the host",
            hint=f"export {name} before starting codecage, or remove this credential",
        )
    return value.strip().encode("utf-8")


def _from_file(where: str, path: Path | None, base_dir: Path | None) -> bytes:
    assert path is not None  # noqa: S101 - the model has one source
    path = path.expanduser()
    if not path.is_absolute():
        if base_dir is None:
            raise ConfigError(
                f"{where}: the file {path} is relative and there is no config file to read it from",
                hint="give the credential file as an absolute path",
            )
        path = base_dir / path
    try:
        # No FIFO or device can hold the start up: open without blocking, then check.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(
            f"{where}: the file {path} cannot be read: {exc.strerror or exc}",
            hint="create it (readable by the user codecage runs as), or remove this credential",
        ) from exc
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ConfigError(f"{where}: {path} is not a regular file")
        data = handle.read(_FILE_MAX_BYTES + 1)
    if len(data) > _FILE_MAX_BYTES or not data.strip():
        raise ConfigError(
            f"{where}: the file {path} is empty or larger than {_FILE_MAX_BYTES} bytes",
            hint="put the secret alone in the file, on one line",
        )
    return data.strip()


# --- scrubbing ---------------------------------------------------------------------------


def encoded_forms(secret: bytes) -> list[bytes]:
    """The secret and the base64 text (standard and URL-safe) that its bytes become at each
    of the three alignments inside a longer encoded value, without the characters at either
    end that depend on the neighbouring bytes. Fragments shorter than 8 are left out."""
    forms = {secret}
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + secret + b"\0\0")
        # Character i carries bits [6i, 6i+6) of the input; keep those within the secret.
        first = -(-8 * offset // 6)
        last = (8 * (offset + len(secret))) // 6
        fragment = encoded[first:last]
        if len(fragment) >= _MIN_ENCODED:
            forms.add(fragment)
            forms.add(fragment.translate(bytes.maketrans(b"+/", b"-_")))
    return sorted(forms, key=len, reverse=True)


@dataclass(frozen=True, slots=True)
class SecretForms:
    """Every form of a set of secrets, compiled once (`secret_forms`)."""

    pattern: re.Pattern[bytes] | None  # None: no secrets, nothing to scrub
    longest: int

    def scrub(self, data: bytes) -> bytes:
        """`data` (whole) with every form replaced by [CREDENTIAL]."""
        return data if self.pattern is None else self.pattern.sub(MARKER, data)


def secret_forms(secrets: Iterable[bytes]) -> SecretForms:
    """The scrubber's forms of `secrets` (`encoded_forms`), as one pattern."""
    forms = {form for secret in secrets for form in encoded_forms(secret)}
    if not forms:
        return SecretForms(pattern=None, longest=0)
    # Longest first: at one position the longest form wins, the same whatever the chunks.
    ordered = sorted(forms, key=lambda f: (-len(f), f))
    pattern = re.compile(b"|".join(re.escape(form) for form in ordered))
    return SecretForms(pattern=pattern, longest=len(ordered[0]))


def scrub_headers(headers: Headers, secrets: SecretForms | Iterable[bytes]) -> Headers:
    """Response headers with every secret (names and values) replaced by [CREDENTIAL];
    `secrets` is the secrets themselves or their compiled `secret_forms`.

    Raises:
        Nothing.
    """
    forms = secrets if isinstance(secrets, SecretForms) else secret_forms(secrets)
    return [(forms.scrub(k), forms.scrub(v)) for k, v in headers]


class ResponseScrubber:
    """Replaces every secret (and its base64 forms) in a byte stream with [CREDENTIAL],
    across chunk boundaries, in bounded memory: it holds back at most the longest form
    less one byte, which `flush` releases at the end of the stream."""

    def __init__(self, secrets: SecretForms | Iterable[bytes]) -> None:
        self._forms = secrets if isinstance(secrets, SecretForms) else secret_forms(secrets)
        self._pattern = self._forms.pattern
        self._keep = max(0, self._forms.longest - 1)
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The scrubbed bytes that can be released after `chunk`.

        Raises:
            Nothing.
        """
        if self._pattern is None:
            return chunk
        data = self._pending + chunk
        # A form starting before `safe` lies wholly in `data`: matching there is final.
        safe = len(data) - self._keep
        out: list[bytes] = []
        position = 0
        for match in self._pattern.finditer(data):
            if match.start() >= safe:
                break
            out += (data[position : match.start()], MARKER)
            position = match.end()
        cut = max(position, safe)
        out.append(data[position:cut])
        self._pending = data[cut:]
        return b"".join(out)

    def flush(self) -> bytes:
        """What was held back, scrubbed: the end of the stream.

        Raises:
            Nothing.
        """
        rest, self._pending = self._pending, b""
        return self._forms.scrub(rest)
