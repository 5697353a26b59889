"""Guest code for the bridge tests: the one flood of the raw bridge socket, and the call that
shows what a bad frame left of the bridge."""

from __future__ import annotations

_FLOOD = """
import os, time
os.set_blocking(4, False)
sent, deadline = 0, time.monotonic() + {seconds}
chunk = b"".join(({request}) % (10**6 + i) for i in range({copies}))  # not the runtime's ids
left = memoryview(chunk)
while time.monotonic() < deadline:
    try:
        n = os.write(4, left)
    except BlockingIOError:
        time.sleep(0.01)
        continue
    except OSError:
        break
    sent += n
    left = left[n:] or memoryview(chunk)
sent
"""


def bridge_flood(request: str, seconds: float, copies: int = 64) -> str:
    """Code that writes requests to the raw bridge socket (fd 4) for `seconds`, never
    reading an answer, without blocking (the host may stop reading); its value is how many
    bytes the host took. `request` is a bytes expression of the guest with one %d (the id);
    `copies` of it, with ids that are not the runtime's, make the chunk written again and
    again."""
    return _FLOOD.format(seconds=seconds, request=request, copies=copies)


NEXT_CALL = """
started = time.monotonic()
try:
    scrub("after")
    outcome = "answered"
except ToolCallError as exc:
    outcome = exc.kind
waited = time.monotonic() - started
"""
"""Guest code, after code that wrote a bad frame to fd 4: one more bridge call, with `outcome`
("answered", or the kind of the `ToolCallError`) and `waited` (its seconds) left set. The
guest has `time`, `ToolCallError` and `scrub` imported."""
