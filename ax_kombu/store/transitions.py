"""Compare-and-set moves of task rows: one ``UPDATE … WHERE status IN (…)`` each.

The rowcount (or RETURNING list) decides who won, so two nodes racing for the
same task can never both move it. Worker moves are fenced by attempt: a
stale message from an earlier attempt moves nothing. The allowed moves are
:data:`ax_kombu.core.states.TRANSITIONS`.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Connection, TextClause, text, update

from ax_kombu.core.states import FINAL, S, Status, check
from ax_kombu.exceptions import IllegalTransition
from ax_kombu.store.schema import tasks
from ax_kombu.store.waits import NOTIFY_MOVED, notify_ended


def transition(conn: Connection, task_ids: Collection[int], sources: Iterable[Status],
               target: Status, *, attempt: int | None = None,
               values: Mapping[str, Any] | None = None) -> list[int]:
    """Move every task in ``task_ids`` that is in one of ``sources`` to ``target``.

    Args:
        attempt: if given, only a row whose attempt equals it moves (fencing).
        values: other columns to set in the same statement.
    Returns:
        The ids that moved (the others were not in a source state); a move to a final
        status announces them to waiters (:func:`ax_kombu.store.waits.notify_ended`).
    Raises:
        IllegalTransition: a source may not move to ``target``; nothing is changed.
    """
    sources = check(sources, target)
    if not task_ids:
        return []
    stmt = (update(tasks)
            .where(tasks.c.task_id.in_(list(task_ids)), tasks.c.status.in_(sources))
            .values(status=target, **(values or {}))
            .returning(tasks.c.task_id))
    if attempt is not None:
        stmt = stmt.where(tasks.c.attempt == attempt)
    moved = [r[0] for r in conn.execute(stmt)]
    if target in FINAL:
        notify_ended(conn, moved)
    return moved


# -- batched, attempt-fenced moves for workers -----------------------------------------------
# Each takes many (task_id, attempt) pairs and is ONE statement: an UPDATE joined to the
# batch, passed as ONE JSON parameter (an array of rows; PostgreSQL: jsonb_array_elements,
# SQLite: json_each). One string costs the worker far less CPU than one array per column
# (psycopg2 adapts every element of an array in turn, keeping the GIL; PostgreSQL's time
# per row fell too: docs/benchmarks.md, "Issue 21, fourth session").
# The status test is written COALESCE(t.status, '') = … so that no planner drives the join
# by the (status, trigger_time) index — a walk over every DISPATCHING or RUNNING row,
# possibly 100,000s — instead of one primary-key lookup per batch row.

_PG_TYPES = {"id": "BIGINT", "att": "INTEGER", "st": "TEXT", "at": "BIGINT", "err": "TEXT",
             "res": "TEXT", "type": "TEXT", "node": "TEXT", "trig": "BIGINT", "disp": "BIGINT",
             "start": "BIGINT", "fin": "BIGINT", "out": "TEXT", "dur": "BIGINT",
             "inc": "INTEGER"}


@functools.lru_cache(maxsize=16)
def _batch_sql(dialect: str, columns: tuple[str, ...], template: str) -> TextClause:
    if dialect == "postgresql":
        picks = ", ".join(f"CAST(e ->> {i} AS {_PG_TYPES[c]}) AS {c}"
                          for i, c in enumerate(columns))
        source = f"(SELECT {picks} FROM jsonb_array_elements(CAST(:rows AS jsonb)) AS e) AS v"
    else:
        picks = ", ".join(f"json_extract(value, '$[{i}]') AS {c}" for i, c in enumerate(columns))
        source = f"(SELECT {picks} FROM json_each(:rows)) AS v"
    return text(template.format(source=source))


def execute_batch(conn: Connection, columns: tuple[str, ...], template: str,
                  rows: Sequence[Sequence[Any]], **params: Any) -> Any:
    """Run ``template`` (a batched move: see :func:`_batch_sql`) over ``rows``, one value per
    name in ``columns``, sent as one JSON parameter; the result, for RETURNING rows."""
    stmt = _batch_sql(conn.dialect.name, columns, template)
    params["rows"] = orjson.dumps([r if type(r) is tuple else list(r) for r in rows]).decode()
    return conn.execute(stmt, params)


def _run_batch(conn: Connection, columns: tuple[str, ...], template: str,
               rows: Sequence[Sequence[Any]], **params: Any) -> list[int]:
    if not rows:
        return []
    return [r[0] for r in execute_batch(conn, columns, template, rows, **params)]


class Started(NamedTuple):
    """A task a worker moved to RUNNING, as its row stores it: what the run is.

    The message that asked for the start only names ``(task_id, attempt)``; these
    columns, not the message's copies, decide what runs. ``payload`` is the
    stored JSON text (unparsed).
    """

    task_id: int
    task_type: str
    trigger_time: int
    priority: str
    retry_count: int
    max_retry: int
    timeout_ms: int
    processor_name: str | None
    callback_url: str | None
    payload: str
    trace_id: str
    #: set on occurrences of recurring jobs (the processor's ``ctx.job``, ``ctx.scheduled_at``)
    job: str | None = None
    scheduled_at: int | None = None
    #: claimed by the gated claim: its end wakes what waits on its key or type
    gated: bool = False
    order_key: str | None = None
    shard_index: int | None = None
    shard_total: int | None = None
    #: when this start was written (the attempt's start, for its history row)
    started_at: int | None = None


#: in :class:`Started`'s order; unqualified: SQLite's RETURNING names the updated table only
_STARTED_COLUMNS = ", ".join(Started._fields)

# a task staged ahead of its trigger time (see worker.starts) starts at that time, not now
_STARTED_AT = "CASE WHEN t.trigger_time > :now THEN t.trigger_time ELSE :now END"
_START = """
    UPDATE ax_task AS t SET status = 'RUNNING', started_at = """ + _STARTED_AT + """,
           owner_node = :node
      FROM {{source}}
     WHERE t.task_id = v.id AND t.attempt = v.att AND {moves}{fence}
 RETURNING """ + _STARTED_COLUMNS
_FROM_DISPATCHING = "COALESCE(t.status, '') = 'DISPATCHING'"
# the retry of a start whose reply was lost: rows it did move are RUNNING, by this node,
# with the started_at it wrote (no other start writes that node and that instant). For a
# staged task that is its trigger time, whoever wrote it: a second delivery of the same
# attempt to the same worker, started by another batch while this reply was lost, would
# count as this one's too (two faults at once; a duplicate of one attempt needs a broker
# redelivery racing a lost database reply on the same node).
_OR_STARTED_BY_ME = ("(COALESCE(t.status, '') = 'DISPATCHING' OR (t.status = 'RUNNING' "
                     "AND t.owner_node = :node AND t.started_at = " + _STARTED_AT + "))")
# only the live incarnation of the node starts anything (see store.nodes)
_FENCE = (" AND EXISTS (SELECT 1 FROM ax_node AS n WHERE n.node_id = :node "
          "AND n.incarnation = :inc AND n.stopped_at IS NULL)")
_STARTS = {(resume, fenced): _START.format(moves=_OR_STARTED_BY_ME if resume else _FROM_DISPATCHING,
                                           fence=_FENCE if fenced else "")
           for resume in (False, True) for fenced in (False, True)}

_RELEASE = """
    UPDATE ax_task AS t SET status = 'READY', owner_node = NULL
      FROM {source}
     WHERE t.task_id = v.id AND t.attempt = v.att AND COALESCE(t.status, '') = 'DISPATCHING'
 RETURNING task_id"""

# a staged run withdrawn by its stopping worker before its trigger time: unowned, as it was
_HAND_BACK = """
    UPDATE ax_task AS t SET status = 'DELAYED', owner_node = NULL
      FROM {source}
     WHERE t.task_id = v.id AND t.attempt = v.att AND COALESCE(t.status, '') = 'RUNNING'
       AND t.owner_node = :node
 RETURNING task_id"""

_FINISH = """
    UPDATE ax_task AS t
       SET status = v.st,
           finished_at = CASE WHEN v.st = 'DELAYED' THEN t.finished_at ELSE v.at END,
           trigger_time = CASE WHEN v.st = 'DELAYED' THEN v.at ELSE t.trigger_time END,
           retry_count = t.retry_count + CASE WHEN v.st = 'DELAYED' THEN v.inc ELSE 0 END,
           last_error = CASE WHEN v.st = 'SUCCESS' THEN t.last_error ELSE v.err END,
           result = CASE WHEN v.st = 'SUCCESS' THEN v.res ELSE t.result END,
           owner_node = CASE WHEN v.st = 'DELAYED' THEN NULL ELSE t.owner_node END,
           started_at = COALESCE(v.start, t.started_at)
      FROM {source}
     WHERE t.task_id = v.id AND t.attempt = v.att AND COALESCE(t.status, '') = 'RUNNING'
 RETURNING task_id"""
#: PostgreSQL's: the same move, announcing its final ends in the same statement (no
#: round trip added to the hot path; see ax_kombu.store.waits)
_FINISH_NOTIFYING = ("WITH moved AS (" + _FINISH.replace("RETURNING task_id",
                                                          "RETURNING task_id, status")
                     + ")" + NOTIFY_MOVED)


def start_many(conn: Connection, pairs: Sequence[tuple[int, int]], node: str,
               now_ms: int, *, incarnation: int | None = None,
               resume: bool = False) -> list[Started]:
    """DISPATCHING → RUNNING for each ``(task_id, attempt)`` whose row is at that attempt.

    Sets ``owner_node = node`` (the worker) and ``started_at = now_ms``, or the
    trigger time if that is later: a task staged ahead of its trigger time (the
    scheduler publishes up to ``claim_lead_ms`` early) is fenced now and starts then.
    A cancelled task, or a stale message from an earlier attempt, does not move.
    The same statement returns what each moved row stores (:class:`Started`):
    the worker runs that, never what a message says (anyone who can write to
    the broker can write a message).

    Args:
        incarnation: if given, nothing moves unless it is ``node``'s live
            incarnation (a worker declared dead starts nothing).
        resume: this repeats a call with the same ``now_ms`` whose outcome is
            unknown (the reply was lost): rows that call moved count as moved.
    Returns:
        The rows that moved (each once, even if a pair was given twice).
    """
    if not pairs:
        return []
    template = _STARTS[(resume, incarnation is not None)]
    result = execute_batch(conn, ("id", "att"), template, pairs, now=now_ms, node=node,
                           **({"inc": incarnation} if incarnation is not None else {}))
    return list(map(Started._make, result))


def release_many(conn: Connection, pairs: Sequence[tuple[int, int]]) -> list[int]:
    """DISPATCHING → READY for work a worker received but could not start.

    ``owner_node`` becomes NULL so that a scheduler claims the task again.
    Fenced by attempt like :func:`start_many`; returns the ids that moved.
    """
    return _run_batch(conn, ("id", "att"), _RELEASE, pairs)


def hand_back_many(conn: Connection, pairs: Sequence[tuple[int, int]], node: str) -> int:
    """RUNNING → DELAYED, at the same attempt, for staged runs ``node`` never started.

    ``owner_node`` becomes NULL (a scheduler claims the task again);
    ``trigger_time``, ``retry_count`` and ``started_at`` are left as they are.
    Only a row at its pair's attempt, RUNNING on ``node``, moves: one recovered,
    cancelled or started again meanwhile does not.

    Returns:
        How many rows moved.
    """
    return len(_run_batch(conn, ("id", "att"), _HAND_BACK, pairs, node=node))


#: a run the processor snoozed (``ax.Snooze``): DELAYED again, no retry counted
SNOOZED = "SNOOZED"
#: a run the processor (or a callback's 4xx answer) discarded (``ax.Discard``): FAILED
#: at once, whatever retries were left
DISCARDED = "DISCARDED"


class Finish(NamedTuple):
    """The end of one run: SUCCESS, FAILED, or DELAYED (a retry, or a snooze).

    ``at_ms`` is ``finished_at`` for SUCCESS and FAILED, the new
    ``trigger_time`` for DELAYED.
    """

    task_id: int
    attempt: int
    status: Status
    at_ms: int
    error: str | None = None
    #: SUCCESS: the processor's return value as JSON text (None: none, or not stored)
    result: str | None = None
    #: when the run really started (a run staged in its worker starts after its RUNNING
    #: move wrote ``started_at``); None keeps the written one
    started_at: int | None = None
    #: how the run ended when its status alone does not say: :data:`SNOOZED` (DELAYED
    #: without a retry counted) or :data:`DISCARDED` (FAILED); its attempt's ``outcome``
    kind: str | None = None


_FINISH_TARGETS = frozenset({S.SUCCESS, S.FAILED, S.DELAYED})


def storable(text: str) -> str:
    """``text`` as both stores accept it in a TEXT column: a NUL (PostgreSQL refuses it)
    written as the four characters ``\\x00``, a lone surrogate (no driver encodes it to
    UTF-8) as its escape (``\\udc80``), as Python's ``repr`` shows them. That escape is
    also JSON's, so JSON text (which never contains a raw NUL) reads back the same value."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def _storable(text: str | None) -> str | None:
    return None if text is None else storable(text)


def finish_many(conn: Connection, results: Sequence[Finish]) -> list[int]:
    """RUNNING → SUCCESS | FAILED | DELAYED for each result whose row is at its attempt.

    Columns set: SUCCESS ``finished_at``, ``result``; FAILED ``finished_at``,
    ``last_error``; DELAYED ``trigger_time``, ``retry_count + 1`` (unchanged for a
    :data:`SNOOZED` run), ``last_error`` and ``owner_node = NULL`` (a scheduler
    claims it again); and
    ``started_at`` where the result gives the run's real start.

    ``last_error`` and ``result`` are written :func:`storable` (callers pass them
    capped and as JSON text; this is the store's own guard, for every caller).
    On PostgreSQL the same statement announces the SUCCESS and FAILED ends to waiters
    (:data:`ax_kombu.store.waits.NOTIFY_MOVED`).

    Returns:
        The ids that moved; a task cancelled or recovered meanwhile does not.
    Raises:
        IllegalTransition: a result's status is not one of the three.
    """
    for result in results:
        if result.status not in _FINISH_TARGETS:
            raise IllegalTransition(f"a run cannot end in {result.status}")
    rows = [(r.task_id, r.attempt, str(r.status), r.at_ms, _storable(r.error),
             _storable(r.result), r.started_at, 0 if r.kind == SNOOZED else 1)
            for r in results]
    template = _FINISH_NOTIFYING if conn.dialect.name == "postgresql" else _FINISH
    return _run_batch(conn, ("id", "att", "st", "at", "err", "res", "start", "inc"), template,
                      rows)


class Attempt(NamedTuple):
    """One ended attempt of a task (an ``ax_attempt`` row, or the task row's final one):
    who ran it, when, how it ended (``ax.AttemptView``)."""

    task_id: int
    attempt: int
    task_type: str
    #: the worker that ran it (never started: the scheduler that dispatched it)
    node: str | None
    trigger_time: int
    dispatched_at: int | None
    started_at: int | None
    finished_at: int
    #: SUCCESS, FAILED, RETRY, CANCELLED, LOST or UNACKED (see ax_kombu.store.schema);
    #: SNOOZED (the processor raised ``ax.Snooze``: due again, no retry counted) or
    #: DISCARDED (``ax.Discard``, or a callback's 4xx answer: failed, no retry)
    outcome: str
    error: str | None = None
    duration_ms: int | None = None


_RECORD = """
    INSERT INTO ax_attempt (task_id, attempt, task_type, node, trigger_time, dispatched_at,
                            started_at, finished_at, outcome, error, duration_ms)
    SELECT v.id, v.att, v.type, v.node, v.trig, v.disp, v.start, v.fin, v.out, v.err, v.dur
      FROM {source} WHERE true
        ON CONFLICT (task_id, attempt) DO NOTHING"""
_RECORD_COLUMNS = ("id", "att", "type", "node", "trig", "disp", "start", "fin", "out", "err",
                   "dur")


def record_attempts(conn: Connection, attempts: Sequence[Attempt]) -> None:
    """Add ended attempts to the history, in one statement. An attempt already recorded
    (by the recovery that declared it lost, say) keeps its first record; its ``error``
    is written :func:`storable`."""
    if attempts:
        execute_batch(conn, _RECORD_COLUMNS, _RECORD,
                      [a._replace(error=_storable(a.error)) for a in attempts])
