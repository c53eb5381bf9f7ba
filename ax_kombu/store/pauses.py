"""Paused task types and queues (``ax_pause``, migration 0025): cluster-wide, stored.

A paused type's or queue's tasks stay unclaimed — DELAYED or READY, never DISPATCHING —
and wait, visibly late (``ax_oldest_overdue_seconds`` counts them), until the pause is
lifted; then they are claimed and run, each once. Runs already claimed (DISPATCHING,
RUNNING) are not recalled.

How the schedulers honour it, with no cost while nothing is paused:

* each preload round reads ``ax_pause`` whole (a handful of rows, in the transaction that
  already reads ``ax_node``: :mod:`ax_kombu.scheduler.housekeeper`) and keeps the result
  as a :class:`Paused`, resolved to this node's priorities (a queue is stored by its
  configured name; :meth:`ax_kombu.config_sections.QueueSettings.queue_for`);
* only when it is not empty do the reads and the claim carry :func:`task_filter` (or
  :func:`due_filter` on ``ax_due``): the preload does not load a paused task, and the claim
  refuses one loaded before the pause landed, as does
  :func:`ax_kombu.store.claims.still_claimable`, so it is dropped from memory;
* when a pause is lifted, the scheduler reads its share's whole window again (as when the
  live schedulers change), so the tasks it skipped are loaded at once.

:func:`pause` and :func:`resume` send the schedulers' wake-up (PostgreSQL), so a change
takes effect at their next preload, at once; without wake-ups (SQLite), within
``preload_interval_ms``. A claim already under way may still take a task of a type paused
meanwhile (at most ``claim_lead_ms`` ahead of its time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, TextClause, bindparam, delete, select, text
from sqlalchemy.dialects import postgresql, sqlite

from ax_kombu.core.values import MAX_TASK_TYPE, check_text, show
from ax_kombu.exceptions import ValidationError
from ax_kombu.store.schema import pauses
from ax_kombu.store.tasks import wake_schedulers

#: what may be paused
KINDS = ("type", "queue")


@dataclass(frozen=True, kw_only=True)
class Pause:
    """One stored pause: ``kind`` ``type`` or ``queue``, its name, since when (epoch ms,
    database clock) and who set it."""

    kind: str
    name: str
    paused_at: int
    actor: str


@dataclass(frozen=True)
class Paused:
    """What a scheduler leaves unclaimed: task types, and priorities (of paused queues)."""

    types: frozenset[str] = frozenset()
    priorities: frozenset[str] = frozenset()

    @property
    def any(self) -> bool:
        """Something is paused (the reads and the claim need a filter)."""
        return bool(self.types or self.priorities)

    def lifted_since(self, before: Paused) -> bool:
        """Some type or priority paused in ``before`` is not paused any more."""
        return bool(before.types - self.types or before.priorities - self.priorities)

    def params(self) -> dict[str, list[str]]:
        """The bound values :func:`task_filter` and :func:`due_filter` name."""
        found: dict[str, list[str]] = {}
        if self.types:
            found["paused_types"] = sorted(self.types)
        if self.priorities:
            found["paused_priorities"] = sorted(self.priorities)
        return found


#: nothing paused
NONE = Paused()


class PauseWatch:
    """The pauses a scheduler last read: written by its housekeeper each preload round,
    read by its claimer and its strays' reads (one reference, replaced whole)."""

    def __init__(self) -> None:
        self.current: Paused = NONE


def check(kind: str, name: object, queues: Sequence[str]) -> str:
    """``name`` checked as a task type (``kind`` ``type``: any valid type name) or as one
    of the configured ``queues`` (``kind`` ``queue``).

    Raises:
        ValidationError: an unknown kind, an invalid type name, or an unknown queue.
    """
    if kind == "type":
        return check_text("task_type", name, MAX_TASK_TYPE)
    if kind != "queue":
        raise ValidationError(f"kind must be one of {', '.join(KINDS)}, got {show(kind)}")
    if not isinstance(name, str) or name not in queues:
        raise ValidationError(f"unknown queue {show(name)}: the queues are "
                              f"{', '.join(queues)} (AX_QUEUE_HIGH/DEFAULT/SLOW)")
    return name


def _matches(paused: Paused, alias: str) -> list[str]:
    parts = []
    if paused.types:
        parts.append(f"{alias}task_type IN :paused_types")
    if paused.priorities:
        parts.append(f"{alias}priority IN :paused_priorities")
    return parts


def task_filter(paused: Paused, alias: str = "") -> str:
    """SQL: `` AND`` the ``ax_task`` row (``alias``: e.g. ``"t."``) is not paused; empty
    when nothing is."""
    return "".join(f" AND NOT {part}" for part in _matches(paused, alias))


def due_filter(paused: Paused, task_id: str) -> str:
    """SQL: `` AND`` the task of the ``ax_due`` entry whose id is ``task_id`` is not paused
    (one primary-key probe of ``ax_task`` per entry); empty when nothing is paused."""
    if not paused.any:
        return ""
    return (f" AND NOT EXISTS (SELECT 1 FROM ax_task AS p WHERE p.task_id = {task_id} "
            f"AND ({' OR '.join(_matches(paused, 'p.'))}))")


def bind(stmt: TextClause, paused: Paused) -> TextClause:
    """``stmt`` with the lists :meth:`Paused.params` names bound as expanding lists."""
    names = list(paused.params())
    return stmt.bindparams(*(bindparam(n, expanding=True) for n in names)) if names else stmt


def resolve(rows: Iterable[tuple[str, str]], queue_for: Callable[[str], str],
            priorities: Sequence[str]) -> Paused:
    """The :class:`Paused` of stored ``(kind, name)`` rows for a node whose priority
    ``p`` publishes to ``queue_for(p)``; a paused queue it does not use pauses nothing."""
    types = frozenset(name for kind, name in rows if kind == "type")
    queues = {name for kind, name in rows if kind == "queue"}
    return Paused(types, frozenset(p for p in priorities if queue_for(p) in queues))


def read_rows(conn: Connection) -> list[tuple[str, str]]:
    """Every stored pause as ``(kind, name)``."""
    return [(r[0], r[1]) for r in conn.execute(select(pauses.c.kind, pauses.c.name))]


def pause(conn: Connection, kind: str, name: str, actor: str, now_ms: int) -> bool:
    """Store the pause of ``name`` (a checked type or queue name) and wake the schedulers;
    False when it was paused already (its row is kept as it was)."""
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    done = conn.execute(insert(pauses).values(kind=kind, name=name, paused_at=now_ms,
                                              actor=actor[:128]).on_conflict_do_nothing())
    wake_schedulers(conn, now_ms)
    return bool(done.rowcount)


def resume(conn: Connection, kind: str, name: str, now_ms: int) -> bool:
    """Delete the pause of ``name`` and wake the schedulers; False when it was not paused."""
    done = conn.execute(delete(pauses).where(pauses.c.kind == kind, pauses.c.name == name))
    wake_schedulers(conn, now_ms)
    return bool(done.rowcount)


def list_pauses(conn: Connection) -> list[Pause]:
    """Every pause, types first, then by name."""
    rows = conn.execute(select(pauses).order_by(pauses.c.kind.desc(), pauses.c.name))
    return [Pause(kind=r.kind, name=r.name, paused_at=r.paused_at, actor=r.actor)
            for r in rows]


def waiting_by_pause(conn: Connection, found: Sequence[Pause],
                     priority_of: Callable[[str], str | None]) -> dict[tuple[str, str], int]:
    """How many claimable tasks each pause holds back (a count over the claimable rows per
    pause: for ``ax status`` and the console, never the scheduler). ``priority_of``: the
    priority of a queue name (None: not one of this node's queues)."""
    counts: dict[tuple[str, str], int] = {}
    for p in found:
        if p.kind == "type":
            where, value = "task_type = :v", p.name
        else:
            prio = priority_of(p.name)
            if prio is None:
                counts[p.kind, p.name] = 0
                continue
            where, value = "priority = :v", prio
        counts[p.kind, p.name] = int(conn.execute(
            text(f"{_WAITING} AND {where}"), {"v": value}).scalar() or 0)
    return counts


_WAITING = "SELECT count(*) FROM ax_task WHERE status IN ('CREATED', 'DELAYED', 'READY')"
