"""The processor of the poison-outcome scenario (``-A tests.faults.poison_tasks``): runs whose
error or return value the store could not take as it is (issue 22, item 1).

``poison.task`` appends one JSON line to the payload's ``ledger`` file *before doing
anything else* (task id, attempt, kind, pid), then ends as its payload's ``kind`` says:

* ``nul_error``: raises ``ValueError("bad\\x00byte")``;
* ``huge_error``: raises a ``RuntimeError`` whose text is 2,000,000 letters;
* ``nul_value``: returns ``"bad\\x00byte"``;
* ``surrogate_value``: returns a str with a lone surrogate (as ``os.fsdecode`` gives
  for a file name that is not UTF-8);
* anything else: returns the payload's ``i``.

Appends use ``O_APPEND`` and one ``write`` per line, so lines never interleave.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ax_kombu as ax

HUGE = 2_000_000
NUL_TEXT = "bad\x00byte"
SURROGATE_TEXT = os.fsdecode(b"file-\xff.txt")


def _append(path: str, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)


@ax.processor("poison.task")
def task(payload: dict[str, Any], ctx: Any) -> Any:
    kind = payload["kind"]
    _append(payload["ledger"], {"id": ctx.task_id, "attempt": ctx.attempt, "kind": kind,
                                "pid": os.getpid()})
    if kind == "nul_error":
        raise ValueError(NUL_TEXT)
    if kind == "huge_error":
        raise RuntimeError("x" * HUGE)
    if kind == "nul_value":
        return NUL_TEXT
    if kind == "surrogate_value":
        return SURROGATE_TEXT
    return payload["i"]
