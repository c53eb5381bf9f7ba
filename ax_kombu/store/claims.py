"""The claim: due claimable tasks (DELAYED, READY; CREATED from older producers) →
DISPATCHING for one scheduler node, attempt + 1.

The one statement behind exactly-once dispatch per attempt: a row moves for
exactly one claimer, and every claim carries a new attempt number (the fencing
token workers check).

Claim leads: a task may be claimed ahead of its trigger time, by its runner's lead
(:data:`ax_kombu.core.runners.RUNNERS`): ``claim_lead_ms`` for ax's own runners (their
worker stages the run until its trigger time), or the lead a runner fixes for itself
(:data:`~ax_kombu.core.runners.FIXED_LEADS`), 0 for one whose consumer could not refuse
a cancelled task (claimed only once its trigger time is at or before the claimer's ``now``, its
reading of the database clock, and until then DELAYED/READY: ``cancel`` still wins, and a
scheduler that dies with it in memory leaves it to the others' preload, not to the ack
timeout). The statements below are built from that table, so they name no runner.

A lost reply: a claim whose statement committed but whose answer never arrived (the
connection dropped) is repeated as a *resume*, with the same ``node`` and ``now``: the
rows the lost statement moved (DISPATCHING, ``owner_node = node``, ``dispatched_at =
now``: no other claim writes that pair, see :class:`ax_kombu.scheduler.claimer.Claimer`)
are returned again, at the attempt it gave them, as if claimed now, so the claimer
publishes them instead of leaving them to the ack timeout.

A message that cannot be built (:mod:`ax_kombu.broker.celery_wire`) ends its task alone:
:func:`ax_kombu.store.gates.fail_unbuildable` moves it DISPATCHING → FAILED with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection, Row, TextClause, bindparam, text

from ax_kombu.core.runners import FIXED_LEADS, OFF_AX_QUEUES
from ax_kombu.store.pauses import NONE, Paused, bind, task_filter
from ax_kombu.store.schema import CLAIMABLE, UNPARKED


def off_ax_queues(runner: str = "runner") -> str:
    """SQL, true when ``runner`` (an ``ax_task.runner`` column) names a runner whose tasks
    no ax worker consumes (:data:`ax_kombu.core.runners.OFF_AX_QUEUES`)."""
    return f"{runner} IN ({', '.join(repr(r) for r in OFF_AX_QUEUES)})"


def _plus(lead: int, what: str, sign: str) -> str:
    return what if lead == 0 else f"{what} {sign} {lead}"


def due_by(runner: str = "runner") -> str:
    """SQL: the latest trigger time a claim at ``:now`` takes for the row's runner: ``:now``
    plus its fixed lead, or ``:due_before`` (``now`` + ``claim_reach_ms``: the lead and the
    claim window, at most 1 s)."""
    whens = " ".join(f"WHEN {runner} = '{name}' THEN {_plus(lead, ':now', '+')}"
                     for name, lead in sorted(FIXED_LEADS.items()))
    return f"CASE {whens} ELSE :due_before END" if whens else ":due_before"


def fire_time(column: str = "trigger_time", runner: str = "runner") -> str:
    """SQL: the time the scheduler's timing loop is handed for a task. The loop fires every
    id ``claim_lead_ms`` (``:claim_lead``) before the time it was handed, so a runner with
    a fixed lead is handed its trigger time plus ``claim_lead_ms`` minus that lead: it fires
    when the claim may take it (:func:`due_by`). Others are handed their trigger time."""
    whens = " ".join(f"WHEN {runner} = '{name}' THEN {_plus(lead, ':claim_lead', '-')}"
                     for name, lead in sorted(FIXED_LEADS.items()))
    return f"{column} + CASE {whens} ELSE 0 END" if whens else column


#: what a dispatch message needs of a claimed row, read by name
#: (:func:`ax_kombu.scheduler.dispatcher.to_message`)
_CLAIM_COLUMNS = ("task_id, attempt, task_type, payload, trace_id, trigger_time, timeout_ms, "
                  "priority, retry_count, max_retry, processor_name, callback_url, target_node, "
                  "runner, traceparent, tracestate")

# One conditional UPDATE, as on SQLite. Racing claimers: a row locked by another claim is
# waited for (that claim commits within its one round trip), then its status is tested again,
# so it moves for exactly one of them. Both lock in the same order (primary-key order of
# ANY(:ids)), so two claims do not deadlock; if different plans ever did, PostgreSQL aborts
# one, and its ids go back to be claimed again. This was FOR UPDATE SKIP LOCKED + UPDATE:
# locking first wrote every row twice (lock, then update; docs/benchmarks.md, "End to end
# (issue 4), third session").
#
# A row is due by :now plus its runner's fixed lead, or by :due_before (see the module
# docstring).
# A resume also returns the rows the lost statement moved, unchanged (SET reads the old row:
# a row already DISPATCHING keeps its attempt).
_CLAIM = """
    UPDATE ax_task
       SET status = 'DISPATCHING', attempt = attempt{bump},
           owner_node = :node, dispatched_at = :now{set}
     WHERE task_id {ids} AND {moves}
       AND trigger_time <= """ + due_by() + """{gate}
 RETURNING """ + _CLAIM_COLUMNS
_RESUME = {"moves": f"({CLAIMABLE} OR (status = 'DISPATCHING' "
                    "AND owner_node = :node AND dispatched_at = :now))",
           "bump": " + CASE WHEN status = 'DISPATCHING' THEN 0 ELSE 1 END"}
_FRESH = {"moves": CLAIMABLE, "bump": " + 1"}
# The ordinary claim leaves gated tasks to the gated claim (ax_kombu.store.gates): those with
# a gate, or of a type with a limit (one primary-key probe of the small ax_limit table).
_UNGATED = (" AND gate IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM ax_limit AS l WHERE l.task_type = ax_task.task_type)")
_FORMS = {(g, r): {"set": ", gated = true" if g else "", "gate": "" if g else _UNGATED,
                   **(_RESUME if r else _FRESH)}
          for g in (False, True) for r in (False, True)}

#: PostgreSQL takes the ids as one array; elsewhere they expand into IN (…)
_CLAIM_PG = {k: text(_CLAIM.format(ids="= ANY(:ids)", **f)) for k, f in _FORMS.items()}
_CLAIM_GENERIC = {k: text(_CLAIM.format(ids="IN :ids", **f)).bindparams(
    bindparam("ids", expanding=True)) for k, f in _FORMS.items()}


@lru_cache(maxsize=64)
def _claim_paused(pg: bool, form: tuple[bool, bool], paused: Paused) -> TextClause:
    """The claim statement of ``form`` refusing ``paused``'s tasks (only while something
    is paused: the statements above stay as they are)."""
    f = _FORMS[form]
    sql = _CLAIM.format(ids="= ANY(:ids)" if pg else "IN :ids",
                        **{**f, "gate": f["gate"] + task_filter(paused)})
    stmt = bind(text(sql), paused)
    return stmt if pg else stmt.bindparams(bindparam("ids", expanding=True))


def claim(conn: Connection, task_ids: Sequence[int], node: str, now_ms: int,
          due_before: int | None = None, *, gated: bool = False,
          resume: bool = False, paused: Paused = NONE) -> list[Row[Any]]:
    """Claim due tasks for dispatch by ``node``: DELAYED/READY → DISPATCHING, attempt + 1.

    One conditional statement for the whole batch: a row moves only if it is
    still DELAYED/READY when the statement reaches it (after waiting for a
    racing claim's lock, PostgreSQL tests it again), so every row is returned
    to exactly one claimer. Rows due after ``due_before`` (default ``now_ms``)
    are left alone.

    A task whose runner fixes its own lead is due by ``now_ms`` plus that lead, never
    ``due_before`` (:func:`due_by`; see the module docstring).

    Gated tasks (:mod:`ax_kombu.store.gates`) are left alone unless ``gated``: the gated
    claim passes it for the tasks it decided may start, and marks them.

    Tasks of ``paused`` types and priorities (:mod:`ax_kombu.store.pauses`) are left alone:
    one the scheduler loaded before the pause landed is refused here.

    Args:
        resume: this repeats, with the same ``node``, ``now_ms`` and ``due_before``, a call
            whose outcome is unknown (its reply was lost): the rows that call moved are
            returned too, at the attempt it gave them. ``node`` must not have claimed at
            ``now_ms`` in any other call.
    Returns:
        The claimed rows, with the columns a dispatch message needs (:data:`_CLAIM_COLUMNS`).
    """
    if not task_ids:
        return []
    params = {"ids": list(task_ids), "node": node, "now": now_ms,
              "due_before": now_ms if due_before is None else due_before}
    pg = conn.dialect.name == "postgresql"
    if paused.any:
        params.update(paused.params())
        return list(conn.execute(_claim_paused(pg, (gated, resume), paused), params))
    stmt = (_CLAIM_PG if pg else _CLAIM_GENERIC)[gated, resume]
    return list(conn.execute(stmt, params))


_STILL_CLAIMABLE = """
    SELECT task_id, """ + fire_time() + """ AS fire,
           gate IS NOT NULL OR EXISTS (SELECT 1 FROM ax_limit AS l
                                        WHERE l.task_type = ax_task.task_type) AS gated
      FROM ax_task
     WHERE task_id IN :ids AND """ + CLAIMABLE + " AND " + UNPARKED
_STILL_CLAIMABLE_SQL = text(_STILL_CLAIMABLE).bindparams(bindparam("ids", expanding=True))


@lru_cache(maxsize=16)
def _still_claimable_paused(paused: Paused) -> TextClause:
    return bind(text(_STILL_CLAIMABLE + task_filter(paused)), paused).bindparams(
        bindparam("ids", expanding=True))


def still_claimable(conn: Connection, task_ids: Sequence[int], *, claim_lead_ms: int = 0,
                    paused: Paused = NONE) -> list[tuple[int, int, bool]]:
    """Of ``task_ids`` (ids a claim skipped), those still claimable, not parked and not
    ``paused`` (a paused one is dropped from the scheduler's memory: the preload reads it
    again when its pause is lifted):
    ``(task_id, trigger_time, gated)`` — gated ones go to the gated claim
    (:mod:`ax_kombu.store.gates`), the others were locked by a racing claim that
    failed, or have a runner's fixed lead and are not due yet. Such a task's time is the
    one :func:`fire_time` gives it with ``claim_lead_ms``."""
    if not task_ids:
        return []
    params: dict[str, Any] = {"ids": list(task_ids), "claim_lead": claim_lead_ms}
    stmt = _STILL_CLAIMABLE_SQL
    if paused.any:
        params.update(paused.params())
        stmt = _still_claimable_paused(paused)
    return [(r.task_id, r.fire, bool(r.gated)) for r in conn.execute(stmt, params)]
