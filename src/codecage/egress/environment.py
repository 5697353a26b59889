"""What a sandbox allowed egress is told: the proxy variables that send its clients through
the relay (guest/relay.py) to its socket on the host proxy, and the CA bundle to trust.
Shared by a run's sandbox (`engine.egress`) and a sandboxed upstream server's
(`bridge.sandboxed`); light on purpose: a plain run imports nothing of the proxy.
"""

from __future__ import annotations

from codecage.guest import contract

_PROXY_URL = f"http://127.0.0.1:{contract.EGRESS_RELAY_PORT}"
# Not through the relay: `localhost`, the sandbox's own loopback (a server the code starts
# itself). The loopback addresses go through it: `--allow-host 127.0.0.1:8000` is a service
# on the host's loopback, which urllib and requests reach only through the proxy (with
# 127.0.0.1 here they connected to the sandbox's own loopback and were refused); the proxy
# refuses them unless a rule names that address.
_NO_PROXY = "localhost"


def proxy_env(*, with_ca: bool) -> dict[str, str]:
    """The proxy variables (both cases: curl reads lower case) and, when the proxy has a CA,
    the variables that make TLS clients trust the bundle at `contract.EGRESS_CA_BUNDLE`."""
    found: dict[str, str] = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        found[name] = found[name.lower()] = _PROXY_URL
    found["NO_PROXY"] = found["no_proxy"] = _NO_PROXY
    if with_ca:
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"):
            found[name] = contract.EGRESS_CA_BUNDLE
    return found
