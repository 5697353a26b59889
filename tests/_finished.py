"""A finished run as the audit trail takes it (`Finished`), built from a real result: the
audit tests hand these to stores and trails without a face in between."""

from __future__ import annotations

import datetime
import uuid

from codecage import ExecutionResult
from codecage.audit.record import Caller, Finished


def finished_run(
    result: ExecutionResult,
    code: str = "1",
    *,
    caller: Caller | None = None,
    profile: str | None = None,
    fresh_id: bool = False,
) -> Finished:
    """`result` finished now, run by `caller` (a library caller by default) through the
    library face; with `fresh_id`, under an execution id of its own, so that one result
    can be recorded many times."""
    now = datetime.datetime.now(datetime.UTC)
    if fresh_id:
        result = result.model_copy(update={"execution_id": uuid.uuid4().hex})
    return Finished(
        result=result,
        code=code,
        caller=caller or Caller("library"),
        face="library",
        profile=profile,
        allowed_imports=(),
        started_at=now,
        finished_at=now,
    )
