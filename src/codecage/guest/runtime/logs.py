"""The agent's `logger`: JSON lines on stderr. Imported only when the code first uses
`codecage.runtime.logger` (`logging` costs a few ms at import; most programs never log)."""

from __future__ import annotations

import _thread
import json
import logging
import sys
from typing import Any

_made = _thread.allocate_lock()  # two threads' first use make one handler, not two


class _JsonLines(logging.Formatter):
    standard = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"level": record.levelname.lower(), "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in self.standard:
                entry.setdefault(key, value)  # an extra field cannot replace level/msg
        if record.exc_info:
            entry.setdefault("exception", self.formatException(record.exc_info))
        return json.dumps(entry, default=str, ensure_ascii=False)


class _Stderr(logging.Handler):
    """Writes to whatever sys.stderr is at the time (it may be redirected)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def agent_logger() -> logging.Logger:
    """The logger "agent", with codecage's handler (added once, whoever asks first)."""
    log = logging.getLogger("agent")
    with _made:
        log.setLevel(logging.INFO)
        log.propagate = False
        if not any(h.name == "codecage" for h in log.handlers):
            handler = _Stderr()
            handler.name = "codecage"
            handler.setFormatter(_JsonLines())
            log.addHandler(handler)
    return log
