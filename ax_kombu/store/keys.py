"""What an enqueue does with a business key already taken: take it, or replace the holder.

The verdicts (:class:`Verdict`) come from :class:`ax_kombu.store.enqueue._Dedup`, under the
enqueue's key locks; this module carries out the two that change an existing task, each as
a compare-and-set whose rowcount decides (a holder that moved on meanwhile makes the row a
duplicate):

* **take** (``unique="pending"``, the holder has finished): the holder gives the key up —
  ``biz_key`` → ``released_key`` where its status is still final (``ax retry`` may have
  brought it back) — and the new row is inserted holding it.
* **replace** (``on_conflict="replace"``, the holder has not started): the holder takes the
  row's payload and trigger time, as :func:`ax_kombu.store.moves.move` moves a task, and
  the move is recorded. A holder of this same batch is replaced in memory.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, update

from ax_kombu.core import states
from ax_kombu.exceptions import IllegalTransition, TaskNotFound
from ax_kombu.store import moves
from ax_kombu.store.schema import tasks

_FINAL = sorted(str(s) for s in states.FINAL)


class Holder(NamedTuple):
    """The task holding a ``(task_type, biz_key)``: its id and status, or the row of this
    batch that takes it (``fresh``)."""

    task_id: int
    status: str
    fresh: Mapping[str, Any] | None = None


class Verdict(NamedTuple):
    """What enqueue does with one row: ``new`` (insert it), ``take`` (insert it once the
    finished holder of its key gave the key up), ``replace`` (the pending holder takes the
    row's payload and time) or ``duplicate``; ``task_id`` is the task the caller gets."""

    kind: str
    task_id: int
    holder: Holder | None = None

    @property
    def creates(self) -> bool:
        """The row is inserted (``new`` or ``take``)."""
        return self.kind in ("new", "take")


def settle(conn: Connection, rows: Sequence[Mapping[str, Any]], verdicts: list[Verdict],
           now_ms: int) -> list[Verdict]:
    """Carry out the ``take`` and ``replace`` verdicts; returns the verdicts as they stand
    (one whose compare-and-set lost is a ``duplicate`` of the holder)."""
    out = list(verdicts)
    taking = {v.holder.task_id for v in out if v.kind == "take" and v.holder is not None}
    released = _release(conn, sorted(taking))
    for i, (row, verdict) in enumerate(zip(rows, out, strict=True)):
        holder = verdict.holder
        if holder is None:
            continue
        if verdict.kind == "take" and holder.task_id not in released:
            out[i] = verdict._replace(kind="duplicate", task_id=holder.task_id, holder=None)
        elif verdict.kind == "replace" and not _replace(conn, holder, row, now_ms):
            out[i] = verdict._replace(kind="duplicate", holder=None)
    return out


def _release(conn: Connection, task_ids: list[int]) -> set[int]:
    if not task_ids:
        return set()
    stmt = (update(tasks)
            .where(tasks.c.task_id.in_(task_ids), tasks.c.status.in_(_FINAL))
            .values(released_key=tasks.c.biz_key, biz_key=None)
            .returning(tasks.c.task_id))
    return set(conn.execute(stmt).scalars())


def _replace(conn: Connection, holder: Holder, row: Mapping[str, Any], now_ms: int) -> bool:
    """Give the holder ``row``'s payload and trigger time; False if it could not move."""
    if holder.fresh is not None:  # written by this very batch: not in the table yet
        fresh = cast(MutableMapping[str, Any], holder.fresh)
        for column in ("payload", "fingerprint", "trigger_time", "status"):
            fresh[column] = row[column]
        if fresh.get("order_key") is not None:
            fresh["order_seq"] = row["trigger_time"]
        return True
    change = moves.Change(to_time=row["trigger_time"], kind="replace", payload=row["payload"],
                          fingerprint=row["fingerprint"])
    try:
        moves.move(conn, moves.Target(task_id=holder.task_id), change, now_ms,
                   wake_before_ms=0)  # the enqueue wakes the schedulers for its rows
    except (IllegalTransition, TaskNotFound):  # started, finished or gone meanwhile
        return False
    return True
