"""The numbers the requirement tests hold the code to, each copied from where it is written
down (docs/, a standard), never imported from the module it bounds."""

from __future__ import annotations

import string

# docs/configuration.md, `max_output_bytes`: "bytes, for stdout and for stderr each",
# default 1,048,576, accepted 1024 - 268,435,456.
DEFAULT_MAX_OUTPUT_BYTES = 1_048_576
CAPPED_STREAM_BYTES = 4096

# RFC 5321 4.5.3.1.1 (local part); the root zone's longest TLD, XN--VERMGENSBERATUNG-PWB.
EMAIL_MAX_LOCAL_PART = 64
EMAIL_MAX_TLD = 24

# docs/mcp.md: images the code writes come back as image content, "at most 5".
MAX_IMAGES_PER_REPLY = 5


def flood(stream: str, total_bytes: int) -> str:
    """Guest code that writes `total_bytes` of 100-byte ASCII lines to `stream`."""
    lines = total_bytes // 100
    return f"import sys\nfor _ in range({lines}):\n    sys.{stream}.write('e' * 99 + '\\n')\n"


def address(local_length: int, tld_length: int) -> str:
    """An address with a local part and a TLD of exactly these lengths (letters, digits and
    the dots RFC 5322 allows inside a local part)."""
    pool = string.ascii_lowercase + string.digits
    local = "".join(pool[i % len(pool)] for i in range(local_length))
    if local_length > 2:
        local = local[0] + "." + local[2:]
    tld = "".join(string.ascii_lowercase[i % 26] for i in range(tld_length))
    return f"{local}@mail.example-{tld_length}.{tld}"
