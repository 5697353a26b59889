"""The egress proxy's certificate authority: one per installation, trusted by the sandboxes.

For a host with a configured credential the proxy terminates the sandbox's TLS itself, so
that it can put the credential into the request; the sandbox must then trust a certificate
the proxy made for that host. This module makes (once) and loads that CA, issues the
per-host leaf certificates, and writes the CA bundle the sandbox trusts (the system's CAs
plus this one; every other host is tunnelled untouched and verified by the code against
the system's CAs).

- **Where**: `/var/lib/codecage/egress-ca` for root, `$XDG_DATA_HOME/codecage/egress-ca`
  (`~/.local/share/...`) otherwise (`packages.user_data_dir`, the packages directory's
  rule), or the directory the caller names.
- **What**: `ca.key` (EC P-256, PKCS#8 PEM, mode 0600) and `ca.pem` (self-signed,
  basicConstraints CA with path length 0, "codecage egress CA <short id>", 10 years) in a
  directory of mode 0700. The key is the crown jewel: whoever reads it can make certificates
  every sandbox of this installation trusts. It is refused when another user owns it or the
  directory, when group or others can write either (or read the key), and when any
  directory above could be changed by another user (the config file's trust rule).
- **Rotation**: delete the directory; the next start makes a new CA (running sandboxes keep
  the bundle they started with, so rotate between runs).
- **Leaves**: one per host (DNS name or IP address in the SAN), signed by the CA, valid for
  `leaf_days` (1 to 30), renewed after half of that; the server contexts are cached per host
  in a bounded LRU. Their keys stay in memory (loaded through a memfd, never a named file).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import secrets
import ssl
import stat
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from codecage.config import create_directory, trusted_directory, untrusted_reason
from codecage.errors import ConfigError
from codecage.fdio import locked
from codecage.packages import user_data_dir

log = logging.getLogger(__name__)

SYSTEM_DIR = Path("/var/lib/codecage/egress-ca")
KEY_NAME = "ca.key"
CERT_NAME = "ca.pem"
BUNDLE_NAME = "egress-ca-bundle.pem"
_LOCK_NAME = ".lock"
_CA_DAYS = 3650
_LEAF_DAYS_DEFAULT = 7
_LEAF_DAYS_BOUNDS = (1, 30)
_CACHE_HOSTS = 256
_BACKDATE = datetime.timedelta(hours=1)  # a sandbox's clock a little behind ours still accepts
_FILE_MAX_BYTES = 64 * 1024
_SYSTEM_BUNDLE_MAX_BYTES = 16 * 1024 * 1024
# Where distributions keep the system's CA bundle, after Python's own default paths.
_KNOWN_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine, Arch
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/ca-bundle.pem",  # openSUSE
    "/etc/ssl/cert.pem",  # macOS, some BSDs
)
_HINT_ROTATE = (
    "the CA directory must be changeable only by root or you; to start afresh, delete "
    "the directory (a new CA is made on the next start) and restart codecage"
)


def default_directory(environ: Mapping[str, str] | None = None) -> Path:
    """Where the CA lives by default: /var/lib/codecage/egress-ca for root, else
    `$XDG_DATA_HOME/codecage/egress-ca` (`~/.local/share/codecage/egress-ca`)."""
    if os.geteuid() == 0:
        return SYSTEM_DIR
    return user_data_dir("egress-ca", environ)


@dataclass(frozen=True, slots=True)
class _Leaf:
    context: ssl.SSLContext
    renew_at: datetime.datetime


class CertificateAuthority:
    """The installation's CA (`load_or_create`), its leaf certificates and its bundle."""

    def __init__(
        self,
        key: ec.EllipticCurvePrivateKey,
        cert: x509.Certificate,
        *,
        leaf_days: int = _LEAF_DAYS_DEFAULT,
        cache_hosts: int = _CACHE_HOSTS,
    ) -> None:
        low, high = _LEAF_DAYS_BOUNDS
        if not low <= leaf_days <= high:
            raise ValueError(f"leaf_days={leaf_days}: give {low} to {high} days")
        self._key = key
        self.cert = cert
        self.cert_pem: bytes = cert.public_bytes(serialization.Encoding.PEM)
        """The CA's certificate (PEM), what the sandbox trusts."""
        self._leaf_days = leaf_days
        self._cache_hosts = max(1, cache_hosts)
        self._leaves: OrderedDict[str, _Leaf] = OrderedDict()
        self._lock = threading.Lock()  # the proxy may call from more than one thread
        self._bundle: bytes | None = None

    def __repr__(self) -> str:
        return f"CertificateAuthority({self.name!r})"

    @property
    def name(self) -> str:
        """The CA's common name, "codecage egress CA <short id>"."""
        names = self.cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return str(names[0].value) if names else ""

    @classmethod
    def load_or_create(
        cls, directory: Path | None = None, *, leaf_days: int = _LEAF_DAYS_DEFAULT
    ) -> CertificateAuthority:
        """The CA kept in `directory` (default: `default_directory()`), made there first if
        it holds none. One process makes it; a concurrent one waits and loads it.

        Raises:
            ConfigError: the directory or its files are not trusted (owned or writable by
                another user, the key readable by others), cannot be created, or hold a CA
                that cannot be used (unreadable, expired, key and certificate apart).
        """
        place = default_directory() if directory is None else Path(directory).absolute()
        real = _prepare(place)
        with locked(real / _LOCK_NAME):
            if not os.path.lexists(real / CERT_NAME) and not os.path.lexists(real / KEY_NAME):
                _create(real)
                log.info("egress_ca_created", extra={"directory": str(real)})
            key, cert = _load(real)
        return cls(key, cert, leaf_days=leaf_days)

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for `host` (a DNS name or an IP
        address), signed by this CA; HTTP/1.1 is the only ALPN protocol offered, since the
        proxy reads the requests inside. Cached per host (bounded), renewed before expiry.

        Raises:
            ValueError: `host` is not a DNS name or an IP address.
        """
        name = _normal_host(host)
        now = _now()
        with self._lock:
            leaf = self._leaves.get(name)
            if leaf is not None and now < leaf.renew_at:
                self._leaves.move_to_end(name)
                return leaf.context
        leaf = self._issue(name, now)
        with self._lock:
            self._leaves[name] = leaf
            self._leaves.move_to_end(name)
            while len(self._leaves) > self._cache_hosts:
                self._leaves.popitem(last=False)
        return leaf.context

    def bundle_pem(self) -> bytes:
        """The CA bundle a sandbox trusts: the system's CAs, then this CA."""
        if self._bundle is None:
            system = system_ca_pem()
            if not system:
                log.warning("egress_ca_no_system_bundle")
            self._bundle = system.rstrip(b"\n") + b"\n" + self.cert_pem if system else self.cert_pem
        return self._bundle

    def bundle_file(self, directory: Path, name: str = BUNDLE_NAME) -> Path:
        """Write `bundle_pem()` to `directory/name` (mode 0644, replaced atomically) for the
        sandbox's SSL_CERT_FILE, REQUESTS_CA_BUNDLE and PIP_CERT; return its path.

        Raises:
            OSError: the directory cannot be written.
        """
        target = Path(directory) / name
        _write_atomically(target, self.bundle_pem(), 0o644)
        return target

    def _issue(self, host: str, now: datetime.datetime) -> _Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        validity = datetime.timedelta(days=self._leaf_days)
        cert = _leaf_certificate(host, key, self._key, self.cert, now, validity)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _load_chain(context, pem)
        return _Leaf(context=context, renew_at=now + validity / 2)


# --- the directory -----------------------------------------------------------------------


def _prepare(directory: Path) -> Path:
    """Create the directory (0700; missing parents 0755) if needed; return its checked real
    path."""
    create_directory(
        directory,
        "the egress CA directory",
        mode=0o700,
        hint="run as the directory's owner (root for /var/lib/codecage), or name "
        "another directory the operator owns",
    )
    return check_trusted(directory)


def check_trusted(directory: Path) -> Path:
    """The real path of `directory`, once it and every directory above it are known to be
    changeable only by root or this user (`config.untrusted_reason`).

    Raises:
        ConfigError: it does not exist, is not a directory, or is not trusted.
    """
    return trusted_directory(directory, "the egress CA directory", hint=_HINT_ROTATE)


def _create(directory: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "codecage"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"codecage egress CA {secrets.token_hex(4)}"),
        ]
    )
    now = _now()
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=_CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # The key first: a certificate on disk is the sign that the pair is complete.
    _write_atomically(directory / KEY_NAME, key_pem, 0o600)
    _write_atomically(directory / CERT_NAME, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _load(directory: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key_pem = _read_checked(directory / KEY_NAME, secret=True)
    cert_pem = _read_checked(directory / CERT_NAME, secret=False)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise ConfigError(
            f"the egress CA in {directory} cannot be read: {exc}", hint=_HINT_ROTATE
        ) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ConfigError(
            f"the egress CA in {directory}: {KEY_NAME} is not the key of {CERT_NAME}",
            hint=_HINT_ROTATE,
        )
    if cert.not_valid_after_utc < _now() + datetime.timedelta(days=_LEAF_DAYS_BOUNDS[1]):
        raise ConfigError(
            f"the egress CA in {directory} expires on {cert.not_valid_after_utc:%Y-%m-%d}",
            hint="delete the directory to make a new CA, and restart codecage",
        )
    return key, cert


def _read_checked(path: Path, *, secret: bool) -> bytes:
    """A regular file (no link followed) that only root or this user can change, and, for
    the key, that nobody else can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(
            f"the egress CA file {path} cannot be opened: {exc.strerror or exc}",
            hint="the directory holds half a CA: " + _HINT_ROTATE,
        ) from exc
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        reason = untrusted_reason(path, st) if stat.S_ISREG(st.st_mode) else "not a regular file"
        if reason is None and secret and st.st_mode & 0o077:
            reason = f"the key {path} can be read by group or others (mode {st.st_mode & 0o777:o})"
        if reason is not None:
            raise ConfigError(f"the egress CA is not trusted: {reason}", hint=_HINT_ROTATE)
        return handle.read(_FILE_MAX_BYTES)


def _write_atomically(target: Path, data: bytes, mode: int) -> None:
    fd, temporary = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        Path(temporary).replace(target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# --- certificates ------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _normal_host(host: str) -> str:
    name = host.strip().strip("[]").rstrip(".").lower()
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_label_ok(label) for label in labels):
        raise ValueError(f"{host!r} is not a host name or an IP address")
    return name


def _label_ok(label: str) -> bool:
    return (
        0 < len(label) <= 63
        and label.isascii()
        and all(c.isalnum() or c in "-_" for c in label)
        and not label.startswith("-")
        and not label.endswith("-")
    )


def _subject_alternative(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _leaf_certificate(
    host: str,
    key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: datetime.datetime,
    validity: datetime.timedelta,
) -> x509.Certificate:
    public = key.public_key()
    ca_identifier = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(min(now + validity, ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([_subject_alternative(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_identifier),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _load_chain(context: ssl.SSLContext, pem: bytes) -> None:
    """`load_cert_chain` reads files only; an anonymous memfd keeps the leaf's key off disk."""
    fd = os.memfd_create("codecage-egress-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


# --- the system's CAs --------------------------------------------------------------------


def system_ca_pem() -> bytes:
    """The host's trusted CAs as PEM (the operator's store, not a package's): Python's
    default CA file, else a distribution's well-known bundle, else the certificates of the
    default CA directory; empty when none is found."""
    for candidate in _bundle_candidates():
        with contextlib.suppress(OSError):
            data = Path(candidate).read_bytes()[:_SYSTEM_BUNDLE_MAX_BYTES]
            if b"-----BEGIN CERTIFICATE-----" in data:
                return data
    return _directory_pem(ssl.get_default_verify_paths().capath)


def _bundle_candidates() -> list[str]:
    paths = ssl.get_default_verify_paths()
    found = [p for p in (paths.cafile, paths.openssl_cafile) if p]
    return [*found, *_KNOWN_BUNDLES]


def _directory_pem(capath: str | None) -> bytes:
    if not capath or not Path(capath).is_dir():
        return b""
    parts: list[bytes] = []
    total = 0
    for entry in sorted(Path(capath).iterdir()):
        with contextlib.suppress(OSError):
            data = entry.read_bytes()[:_FILE_MAX_BYTES]
            if b"-----BEGIN CERTIFICATE-----" in data and total < _SYSTEM_BUNDLE_MAX_BYTES:
                parts.append(data.rstrip(b"\n") + b"\n")
                total += len(data)
    return b"".join(parts)
