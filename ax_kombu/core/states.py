"""Task statuses and the transitions allowed between them (pure: no I/O).

::

    (enqueue) ─▶ DELAYED (future) | READY (due)   (a preload only reads them)
    DELAYED | READY ─▶ DISPATCHING             (claimed by a scheduler node)
                    | DELAYED | READY          (moved: reschedule, run_now, a replacing
                                                enqueue; ax_kombu.store.moves)
    DISPATCHING ─▶ RUNNING (a worker took it) | READY (publish failed, ack timeout,
                   worker pool full, an earlier incarnation's claim)
                 | FAILED (dispatched AX_MAX_DISPATCHES times, never started)
    RUNNING ─▶ SUCCESS | FAILED | DELAYED (retry with backoff, also "worker lost")
    FAILED | CANCELLED ─▶ READY              (manual retry: ``ax retry``)
    any non-final ─▶ CANCELLED

CREATED is what producers wrote before migration 0011 (the preload then moved it to
DELAYED/READY); such a row is claimed like a DELAYED one.

Every change is one ``UPDATE … WHERE task_id … AND status IN (…)`` statement
(:mod:`ax_kombu.store.transitions`, :mod:`ax_kombu.store.claims`);
its rowcount (or RETURNING list) decides who won, so two nodes racing for
the same task can never both succeed. A claim increments ``attempt``, the
fencing token: a worker moves a task to RUNNING only when the attempt in its
message equals the row's, so a stale message from an earlier attempt is
refused. That makes dispatch exactly-once *per attempt*; execution is
at-least-once (a task re-dispatched after a lost worker may run again).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from ax_kombu.core.errors import IllegalTransition


class Status(StrEnum):
    CREATED = "CREATED"
    DELAYED = "DELAYED"
    READY = "READY"
    DISPATCHING = "DISPATCHING"
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


S = Status
FINAL = frozenset({S.SUCCESS, S.FAILED, S.CANCELLED})
ACTIVE = frozenset(Status) - FINAL
#: states a scheduler may claim from
CLAIMABLE = (S.CREATED, S.DELAYED, S.READY)

TRANSITIONS: Mapping[Status, frozenset[Status]] = {
    S.CREATED: frozenset({S.DELAYED, S.READY, S.DISPATCHING, S.CANCELLED}),
    # a pending task moved to another time is DELAYED or READY by its new time
    S.DELAYED: frozenset({S.DELAYED, S.READY, S.DISPATCHING, S.CANCELLED}),
    S.READY: frozenset({S.DELAYED, S.READY, S.DISPATCHING, S.CANCELLED}),
    S.DISPATCHING: frozenset({S.RUNNING, S.READY, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCESS, S.FAILED, S.DELAYED, S.CANCELLED}),
    S.SUCCESS: frozenset(),
    S.FAILED: frozenset({S.READY}),
    # the manual retry (``ax retry``, :func:`ax_kombu.store.admin.retry_tasks`) may bring back
    # a cancelled task too; nothing else leaves CANCELLED
    S.CANCELLED: frozenset({S.READY}),
}


def check(sources: Iterable[Status], target: Status) -> tuple[Status, ...]:
    """The sources as a tuple, after checking each may move to ``target``.

    Raises:
        IllegalTransition: some source may not move to ``target``.
    """
    sources = tuple(Status(s) for s in sources)
    if not sources:
        raise IllegalTransition(f"no source state given for a move to {target}")
    for source in sources:
        if target not in TRANSITIONS[source]:
            raise IllegalTransition(f"a task cannot go from {source} to {target}")
    return sources
