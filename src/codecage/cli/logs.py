"""The CLI's logging: to stderr only (stdout belongs to the program's output and to
--json), one line per event with its fields."""

from __future__ import annotations

import json
import logging
import sys

_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message"}


class _FieldsFormatter(logging.Formatter):
    """`LEVEL logger event key=value ...`: the `extra=` fields are the log's content."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}
        line = f"{record.levelname} {record.name} {record.getMessage()}"
        if fields:
            line += " " + " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(verbose: bool) -> None:
    """Logs go to stderr only: stdout belongs to the program's output and to --json."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_FieldsFormatter())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])
    # bandit's plugin loader logs an ERROR for every optional formatter it cannot load.
    logging.getLogger("stevedore").setLevel(logging.CRITICAL)
