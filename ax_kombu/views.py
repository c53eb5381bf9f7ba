"""What the producer API returns: a task's id with what the call did, and read-only views of
a task, its attempts and its moves."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Self

from ax_kombu.core.states import Status
from ax_kombu.store.transitions import Attempt


class TaskId(int):
    """A task id (an ``int``) that also says what this call did: created the task, matched
    an existing one (``duplicate``), or gave a pending one its payload and time
    (``replaced``, with ``on_conflict="replace"``)."""

    created: bool
    replaced: bool
    #: with ``shards=N``: the ids of all N shards, in shard order (this id is shard 0's)
    shards: tuple[int, ...]

    def __new__(cls, value: int, created: bool = True, shards: tuple[int, ...] = (),
                replaced: bool = False) -> Self:
        obj = super().__new__(cls, value)
        obj.created = created
        obj.replaced = replaced
        obj.shards = shards
        return obj

    @property
    def duplicate(self) -> bool:
        """True when the call matched an existing task and changed nothing."""
        return not self.created and not self.replaced


@dataclass(frozen=True)
class TaskView:
    """A read-only snapshot of one task row."""

    task_id: int
    task_type: str
    status: Status
    trigger_time: int
    priority: str
    payload: Any
    retry_count: int
    max_retry: int
    timeout_ms: int
    processor_name: str | None
    callback_url: str | None
    biz_key: str | None
    fingerprint: str
    trace_id: str
    attempt: int
    owner_node: str | None
    created_at: int
    dispatched_at: int | None
    started_at: int | None
    finished_at: int | None
    last_error: str | None
    #: the recurring job this task is an occurrence of, and the occurrence's time (epoch ms)
    job: str | None = None
    scheduled_at: int | None = None
    order_key: str | None = None
    shard_index: int | None = None
    shard_total: int | None = None
    #: a shard of ``shards="workers"``: the worker it was sent to
    target_node: str | None = None
    #: the processor's return value (SUCCESS; None if it returned None or it was not stored)
    result: Any = None
    #: where it runs: 'ax' (a processor), 'callback', 'celery' or 'celery_ax' (a Celery
    #: worker with the AxBootstep); see ax_kombu.store.schema
    runner: str = "ax"
    #: every ended attempt, oldest first (one still under way is not listed: the row's
    #: ``attempt``, ``owner_node`` and ``started_at`` describe it)
    attempts: tuple[Attempt, ...] = ()
    #: the task was moved to the archive tables (``ax archive``, ``AX_RETENTION``)
    archived: bool = False
    #: the biz_key this finished task kept until an ``enqueue(..., unique="pending")``
    #: took it over (``biz_key`` is then None)
    released_key: str | None = None
    #: every move of its trigger time (``reschedule``, ``run_now``, a replacing enqueue),
    #: oldest first
    moves: tuple[Move, ...] = ()
    #: the W3C trace context current when it was enqueued (None: none; see
    #: docs/tracing.md)
    traceparent: str | None = None

    @property
    def last_run_node(self) -> str | None:
        """Deprecated: :attr:`owner_node` (the column was split into
        ``owner_node`` and ``parked`` by migration 0021)."""
        return self.owner_node

    @classmethod
    def from_row(cls, row: Mapping[str, Any], attempts: Sequence[Mapping[str, Any]] = (),
                 archived: bool = False, moves: Sequence[Mapping[str, Any]] = ()) -> TaskView:
        data = {k: row[k] for k in cls.__dataclass_fields__
                if k not in ("attempts", "archived", "moves", "traceparent")}
        data["traceparent"] = row.get("traceparent")
        data["status"] = Status(row["status"])
        data["payload"] = json.loads(row["payload"])
        data["result"] = json.loads(row["result"]) if row.get("result") is not None else None
        return cls(**data, attempts=tuple(Attempt(**a) for a in attempts), archived=archived,
                   moves=tuple(Move(**m) for m in moves))


#: one ended attempt of a task, as ``TaskView.attempts`` lists them (see ax_kombu.store.schema)
AttemptView = Attempt


class Move(NamedTuple):
    """One move of a pending task (``ax_move``): when (epoch ms, DB clock), from which
    trigger time to which, by what (``'reschedule'``, ``'run_now'``, ``'replace'``), and
    the task's attempt then."""

    task_id: int
    moved_at: int
    from_time: int
    to_time: int
    kind: str
    attempt: int
