"""A run's output handed to a caller as it arrives (`RunRequest.on_output`).

The supervising loop (`engine.supervise`) gives each chunk it reads to `OutputStream.feed`,
which only counts it against the output cap and queues it: nothing the caller's callback
does (block, sleep, raise) can hold up the loop that enforces the run's limits. A thread of
its own per run (`codecage-output`) then decodes the chunks incrementally (UTF-8; a
character split across two reads is kept whole; an invalid byte shows as a ``\\x80``-style
escape, as in `ExecutionResult.stdout`), and calls the callback in order, never two calls at
once.

When the host scrubs results, the text is scrubbed before it is handed out, by complete
lines, so a value the program wrote in two pieces is whole again when the scrubber sees
it. A line that does not end is not held forever: after `FLUSH_AFTER_S`, or once it holds
`FLUSH_AT_CHARS` characters, what there is goes out, scrubbed as a cut text (the cap rules
of `policy.scrub.tail`: a possible start of a value is redacted to its end).

Past `cap_bytes` on a stream nothing more of it is streamed; one line says so. A callback
that raises is logged once and not called again; one still busy `DRAIN_S` after the run
ended is abandoned (its thread is a daemon) and the rest of the output is not handed to it.
"""

from __future__ import annotations

import codecs
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

__all__ = [
    "DRAIN_S",
    "FLUSH_AFTER_S",
    "FLUSH_AT_CHARS",
    "OutputCallback",
    "OutputStream",
    "StreamScrub",
]

log = logging.getLogger(__name__)

StreamName = Literal["stdout", "stderr"]
OutputCallback = Callable[[str, str], None]
"""Called with the stream's name ("stdout" or "stderr") and the text that arrived."""
StreamScrub = Callable[[str, bool], str]
"""Scrubs a text; the flag says it was cut (a line not finished yet)."""

FLUSH_AFTER_S: Final = 0.5  # an unfinished line waits this long for its end when scrubbing
FLUSH_AT_CHARS: Final = 4096  # ... or until it is this long
DRAIN_S: Final = 5.0  # how long the end of a run waits for the callback to catch up


@dataclass(slots=True)
class _Stream:
    """One stream's state on the delivery thread."""

    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("backslashreplace")
    )
    pending: str = ""  # an unfinished line, held for the scrubber
    pending_since: float = 0.0
    capped: bool = False
    ends_line: bool = True  # the last text handed out ended with a newline (or none was)


class OutputStream:
    """Hands one run's output to `callback` as it arrives (see the module's docstring).

    Args:
        callback: what the caller gave as `on_output`.
        cap_bytes: `max_output_bytes`: what each stream may stream at most.
        scrub: scrubs text before it is handed out; None: handed out as it comes.
        execution_id: for the log lines.
    """

    def __init__(
        self,
        callback: OutputCallback,
        *,
        cap_bytes: int,
        scrub: StreamScrub | None = None,
        execution_id: str = "",
    ) -> None:
        self._callback = callback
        self._cap_bytes = cap_bytes
        self._scrub = scrub
        self._execution_id = execution_id
        # (stream, bytes read), (stream, None) at its cap, and None after the last chunk.
        self._queue: queue.SimpleQueue[tuple[str, bytes | None] | None] = queue.SimpleQueue()
        self._fed: dict[str, int] = {"stdout": 0, "stderr": 0}
        self._capped: set[str] = set()
        self._streams = {"stdout": _Stream(), "stderr": _Stream()}
        self._stopped = threading.Event()  # the callback failed or was abandoned
        self._thread = threading.Thread(target=self._deliver, name="codecage-output", daemon=True)
        self._thread.start()

    # --- the supervising loop's side -----------------------------------------------------

    def feed(self, stream: str, chunk: bytes) -> None:
        """Queue what was read from `stream` (within the cap); never blocks.

        Raises:
            Nothing.
        """
        if stream in self._capped or not chunk:
            return
        room = self._cap_bytes - self._fed[stream]
        if len(chunk) <= room:
            self._fed[stream] += len(chunk)
            self._queue.put((stream, chunk))
            return
        self._capped.add(stream)
        self._fed[stream] = self._cap_bytes
        if room > 0:
            self._queue.put((stream, chunk[:room]))
        self._queue.put((stream, None))  # the cap: said once, then nothing more of it

    def close(self, drain_s: float = DRAIN_S) -> None:
        """The run's output ended: hand out the rest, waiting at most `drain_s` for it.

        Raises:
            Nothing.
        """
        self._queue.put(None)
        self._thread.join(drain_s)
        if self._thread.is_alive():
            self._stopped.set()
            log.warning(
                "stream.callback_slow",
                extra={"execution_id": self._execution_id, "waited_s": drain_s},
            )

    # --- the delivery thread ---------------------------------------------------------------

    def _deliver(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._until_flush())
            except queue.Empty:
                self._flush_due(time.monotonic())
                continue
            if item is None:
                self._finish()
                return
            name, data = item
            if data is None:
                self._cap(name)
            else:
                self._text(name, self._streams[name].decoder.decode(data))

    def _until_flush(self) -> float | None:
        """Seconds until the first unfinished line is due (None: none is held)."""
        held = [s.pending_since for s in self._streams.values() if s.pending]
        if not held:
            return None
        return max(0.0, min(held) + FLUSH_AFTER_S - time.monotonic())

    def _text(self, name: str, text: str) -> None:
        if self._scrub is None:
            self._emit(name, text)
            return
        state = self._streams[name]
        if text and not state.pending:
            state.pending_since = time.monotonic()
        state.pending += text
        end = state.pending.rfind("\n") + 1
        if end:
            # Complete lines go out whole; what follows the last newline started arriving
            # in this chunk, so its wait starts now.
            lines, state.pending = state.pending[:end], state.pending[end:]
            state.pending_since = time.monotonic()
            self._emit(name, self._scrub(lines, False))
        if len(state.pending) >= FLUSH_AT_CHARS:
            self._flush(name, cut=True)

    def _flush_due(self, now: float) -> None:
        for name, state in self._streams.items():
            if state.pending and now >= state.pending_since + FLUSH_AFTER_S:
                self._flush(name, cut=True)

    def _flush(self, name: str, *, cut: bool) -> None:
        state = self._streams[name]
        held, state.pending = state.pending, ""
        if held and self._scrub is not None:
            self._emit(name, self._scrub(held, cut))

    def _cap(self, name: str) -> None:
        self._flush(name, cut=True)
        state = self._streams[name]
        state.capped = True
        lead = "" if state.ends_line else "\n"
        self._emit(
            name,
            f"{lead}[codecage: {name} is over max_output_bytes: its first "
            f"{self._cap_bytes:,} bytes were streamed, the result keeps its tail too]\n",
        )

    def _finish(self) -> None:
        for name, state in self._streams.items():
            if state.capped:
                continue
            self._text(name, state.decoder.decode(b"", final=True))
            self._flush(name, cut=False)  # the stream ended: its last line is whole

    def _emit(self, name: str, text: str) -> None:
        if not text or self._stopped.is_set():
            return
        self._streams[name].ends_line = text.endswith("\n")
        try:
            self._callback(name, text)
        except Exception as exc:  # the caller's code: any failure stops it, not the run
            self._stopped.set()
            log.warning(
                "stream.callback_failed",
                extra={"execution_id": self._execution_id, "error": type(exc).__name__},
            )
