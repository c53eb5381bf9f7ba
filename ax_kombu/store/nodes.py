"""Liveness of scheduler and worker processes: one ``ax_node`` row per node name, heartbeated.

A node's **name** (``-n``) is stable across restarts; each process start is a
new **incarnation** of it (a number unique to that start). The row says which
incarnation is live. Contracts:

* **Registration takes over from the earlier incarnation** in one transaction:
  what it had claimed but no worker started goes back to READY (a new attempt fences
  its message), and what it was running is retried, or FAILED "worker lost" when no retries
  remain; what a worker had only staged (its listed runs, see
  :mod:`ax_kombu.worker.listing`) gets a new attempt with no retry counted. A process
  whose registration returns has nothing left over from an earlier life under its name.
* **Two live processes never share a name**: registering a name whose live
  incarnation is still heartbeating raises
  :class:`~ax_kombu.exceptions.NodeNameInUse`, and changes nothing. Its pid is
  asked (``kill(pid, 0)``) only when the row was written in this very pid space —
  same boot of the same kernel and same pid namespace (:func:`host_identity`,
  kept in the row's ``info``): containers that share a host name (each its own
  pid 1) or another machine of the same name never pass for "that process is
  gone", nor for this process; without a matching identity the heartbeat's age
  alone decides.
* **A heartbeat is a compare-and-set on the live incarnation**: it returns
  False once the node was declared dead or replaced, and the caller must stop
  acting under that incarnation (see the daemons).
* A node is *dead* when it has not written a heartbeat for the silence window
  (``heartbeat_misses × heartbeat_interval_s``) and did not stop cleanly.
  Whoever notices first marks it stopped with a compare-and-set
  (:func:`claim_dead`), so its tasks are recovered exactly once.
* **Quiet is stored on the row** (``quiet_at``, :func:`set_quiet`): ``ax workers quiet``
  sets it, ``resume`` clears it, and each beat of the worker reads it back in the same
  statement (``RETURNING``), so a worker goes quiet or resumes within one heartbeat at no
  extra round trip. A new process of the name starts consuming (registration writes the
  process's own quiet state, none at start): quiet drains one process, e.g. before a
  deploy. A quiet worker is not counted as consuming its queues (:func:`consumed_queues`,
  :func:`workers_consuming`).
* **Rows of stopped nodes are pruned** (:func:`prune_stopped`) once they have been
  stopped (cleanly, or declared dead) for ``node_retention_s``: default node names are
  new in every process, so without it the table, which every beat and recovery scans,
  only grows. A row is deleted only after the stop that recovered its tasks; a
  process whose row was pruned (paused for longer than the retention) finds its beat
  refused and registers anew, as any fenced node does.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, Row, delete, func, insert, select, text, update

from ax_kombu.config import worker_queue
from ax_kombu.exceptions import NodeNameInUse, ValidationError
from ax_kombu.store import Store
from ax_kombu.store.engine import db_now_ms, now_ms_sql, one_statement
from ax_kombu.store.recovery import recover_running
from ax_kombu.store.schema import nodes


def default_node_id(kind: str) -> str:
    """``kind@host.pid.xxxx``: unique even when a pid is reused."""
    return f"{kind}@{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:4]}"


#: the key of a node row's ``info`` that keeps the :func:`host_identity` of its process
HOST_ID_KEY = "host_id"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_PID_NAMESPACE = Path("/proc/self/ns/pid")


@functools.cache
def host_identity() -> str:
    """Where this process's pid means something: the kernel's boot id and the inode of
    its pid namespace (``"<boot id>/<inode>"``). Two processes that see the same value
    see the same pids; containers of one host differ by namespace, hosts (or reboots)
    by boot id, whatever their host names. ``""`` where either cannot be read (not
    Linux): a pid check is then never trusted."""
    try:
        boot = _BOOT_ID.read_text().strip()
        namespace = os.stat(_PID_NAMESPACE).st_ino
    except OSError:
        return ""
    return f"{boot}/{namespace}" if boot else ""


def same_pid_space(info: str | None) -> bool:
    """Whether a node row's ``info`` (JSON) was written from this process's pid space
    (:func:`host_identity`): only then may its pid be checked here."""
    mine = host_identity()
    if not mine:
        return False
    try:
        recorded = json.loads(info or "{}").get(HOST_ID_KEY)
    except (ValueError, AttributeError):
        return False
    return bool(recorded == mine)


def _info_json(info: Mapping[str, Any]) -> str:
    """``info`` as the row stores it, with this process's :func:`host_identity`."""
    return json.dumps({**info, HOST_ID_KEY: host_identity()})


def pid_running(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


class TakeOver(NamedTuple):
    """What a registration recovered from the earlier incarnation of its name."""

    requeued: int
    running: int


_REQUEUE_DISPATCHING = text(
    "UPDATE ax_task SET status = 'READY', owner_node = NULL "
    "WHERE status = 'DISPATCHING' AND owner_node = :node")


class Heartbeat:
    """Registers one process (a new incarnation of its name) and keeps its heartbeat fresh.

    Args:
        store: where ``ax_node`` lives.
        node_id: the stable node name.
        kind: ``scheduler`` or ``worker``.
        silence_ms: how long a live incarnation may go without a heartbeat before
            another process may take its name over (the dead-node window).
        engine: where the heartbeat writes (default ``store.engine``): a scheduler gives
            its beats an engine of their own, so that no other stage's work (a lock wait,
            a long preload, a full pool) ever delays a beat.
    """

    def __init__(self, store: Store, node_id: str, kind: str, silence_ms: int = 15_000,
                 engine: Engine | None = None) -> None:
        self.store = store
        self.engine = engine if engine is not None else store.engine
        self.node_id = node_id
        self.kind = kind
        self.silence_ms = silence_ms
        #: this process's live incarnation (0 until registered)
        self.incarnation = 0
        #: the row's ``quiet_at`` as the last beat read it back (None: not quiet)
        self.quiet_at: int | None = None
        #: this process asks to be quiet (SIGTSTP): the next beat sets ``quiet_at`` unless set
        self.ask_quiet = False

    def register(self, info: Mapping[str, Any], keep_running: Sequence[int] = ()) -> TakeOver:
        """Become the live incarnation of the name, taking over from the earlier one.

        Args:
            info: published in the row.
            keep_running: task ids this very process is still running (a process
                re-registering after it was declared dead): left RUNNING.
        Returns:
            What was recovered from the earlier incarnation.
        Raises:
            NodeNameInUse: another live process has the name; nothing changed.
        """
        with self.engine.begin() as conn:
            now = db_now_ms(conn)
            self._check_free(conn, now)
            incarnation = max(now, self.incarnation + 1)
            # before the upsert: the recovery reads the earlier incarnation's listed runs
            took = _take_over(conn, self.node_id, now, keep_running)
            self._upsert(conn, now, incarnation, info)
        self.incarnation = incarnation
        return took

    def _check_free(self, conn: Connection, now: int) -> None:
        row = conn.execute(select(nodes).where(nodes.c.node_id == self.node_id)
                           .with_for_update()).first()
        if row is None or row.stopped_at is not None or row.incarnation == self.incarnation:
            return
        same_pids = row.host == socket.gethostname() and same_pid_space(row.info)
        if same_pids and (row.pid == os.getpid() or not pid_running(row.pid)):
            return  # that process is gone: no need to wait for its heartbeat to go stale
        if row.heartbeat_at >= now - self.silence_ms:
            raise NodeNameInUse(
                f"node name {self.node_id!r} is in use by a live {row.kind} "
                f"(pid {row.pid} on {row.host}, heartbeat {now - row.heartbeat_at} ms ago); "
                f"give this process another -n, or stop that one")

    def _upsert(self, conn: Connection, now: int, incarnation: int,
                info: Mapping[str, Any]) -> None:
        values = {"kind": self.kind, "host": socket.gethostname(), "pid": os.getpid(),
                  "incarnation": incarnation, "started_at": now, "heartbeat_at": now,
                  "stopped_at": None, "info": _info_json(info), "listed_runs": None,
                  "quiet_at": self.quiet_at}
        moved = conn.execute(update(nodes).where(nodes.c.node_id == self.node_id)
                             .values(**values)).rowcount
        if not moved:
            conn.execute(insert(nodes).values(node_id=self.node_id, **values))

    def beat(self, info: Mapping[str, Any]) -> bool:
        """Refresh the heartbeat and read ``quiet_at`` back into :attr:`quiet_at` (setting
        it first if :attr:`ask_quiet`); False if this incarnation is no longer the live one."""
        with one_statement(self.engine) as conn:  # no lock outlives a cut (one_statement)
            now = now_ms_sql(conn.dialect.name)
            values: dict[str, Any] = {"heartbeat_at": now, "info": _info_json(info)}
            if self.ask_quiet:
                values["quiet_at"] = func.coalesce(nodes.c.quiet_at, now)
            row = conn.execute(self._if_live(self.incarnation).values(**values)
                               .returning(nodes.c.quiet_at)).first()
        if row is None:
            return False
        self.quiet_at = row.quiet_at
        return True

    def write_listed_runs(self, conn: Connection, incarnation: int, listed: str) -> bool:
        """Set this node's listed runs (``,id,id,``; see :mod:`ax_kombu.worker.listing`) if
        ``incarnation`` is still its live one; False if not (declared dead, or replaced)."""
        return self._set_if_live(conn, incarnation, listed_runs=listed)

    def _set_if_live(self, conn: Connection, incarnation: int, **values: Any) -> bool:
        """Update this node's row if ``incarnation`` is its live one (not stopped or
        declared dead, not replaced); whether it was."""
        return bool(conn.execute(self._if_live(incarnation).values(**values)).rowcount)

    def _if_live(self, incarnation: int) -> Any:
        """An UPDATE of this node's row if ``incarnation`` is its live one."""
        return update(nodes).where(nodes.c.node_id == self.node_id,
                                   nodes.c.incarnation == incarnation,
                                   nodes.c.stopped_at.is_(None))

    def stop(self, conn: Connection | None = None) -> None:
        """Mark this incarnation stopped (a clean exit); in ``conn``'s transaction if given."""
        if conn is None:
            with self.engine.begin() as own:
                self.stop(own)
            return
        conn.execute(update(nodes).where(nodes.c.node_id == self.node_id,
                                         nodes.c.incarnation == self.incarnation)
                     .values(stopped_at=db_now_ms(conn)))


def _take_over(conn: Connection, node: str, now_ms: int, keep: Sequence[int]) -> TakeOver:
    """Recover what tasks an earlier incarnation of ``node`` left (see the module docstring)."""
    requeued = conn.execute(_REQUEUE_DISPATCHING, {"node": node}).rowcount
    running = recover_running(conn, [node], now_ms, keep=keep)
    return TakeOver(int(requeued), len(running))


def claim_dead(conn: Connection, max_silence_ms: int, kind: str | None = None) -> list[str]:
    """Mark nodes silent for longer than ``max_silence_ms`` as stopped; returns their names.

    A node is returned to exactly one caller, however many race. Call this only
    from a process whose own heartbeats have been succeeding for at least
    ``max_silence_ms`` (a process just back from a database outage would judge
    everyone dead).
    """
    now = now_ms_sql(conn.dialect.name)  # no round trip of its own (judged twice a second)
    stmt = (update(nodes)
            .where(nodes.c.stopped_at.is_(None), nodes.c.heartbeat_at < now - max_silence_ms)
            .values(stopped_at=now).returning(nodes.c.node_id))
    if kind is not None:
        stmt = stmt.where(nodes.c.kind == kind)
    return [r[0] for r in conn.execute(stmt)]


def prune_stopped(conn: Connection, stopped_before_ms: int, limit: int = 1000) -> list[str]:
    """Delete the rows of nodes stopped (cleanly or declared dead) before
    ``stopped_before_ms``, at most ``limit``; returns their names. A live row, or one
    silent but not yet declared dead (its tasks not yet recovered), is never deleted."""
    old = (select(nodes.c.node_id)
           .where(nodes.c.stopped_at.is_not(None), nodes.c.stopped_at < stopped_before_ms)
           .limit(limit))
    stmt = (delete(nodes)
            .where(nodes.c.node_id.in_(old), nodes.c.stopped_at.is_not(None),
                   nodes.c.stopped_at < stopped_before_ms)
            .returning(nodes.c.node_id))
    return [r[0] for r in conn.execute(stmt)]


def live_nodes(conn: Connection, max_silence_ms: int) -> list[Row[Any]]:
    """Rows of nodes that have heartbeated within ``max_silence_ms`` and not stopped."""
    now = db_now_ms(conn)
    return list(conn.execute(select(nodes).where(
        nodes.c.stopped_at.is_(None), nodes.c.heartbeat_at >= now - max_silence_ms)
        .order_by(nodes.c.kind, nodes.c.node_id)))


def live_names(conn: Connection, kind: str, alive_after_ms: int) -> list[str]:
    """The names of the ``kind`` nodes not stopped that heartbeated at or after
    ``alive_after_ms`` (database time), sorted."""
    return [r[0] for r in conn.execute(
        select(nodes.c.node_id).where(nodes.c.kind == kind, nodes.c.stopped_at.is_(None),
                                      nodes.c.heartbeat_at >= alive_after_ms)
        .order_by(nodes.c.node_id))]


def _worker_queues(conn: Connection, max_silence_ms: int) -> dict[str, set[str]]:
    """Each live worker's queues (from the ``queues`` in its heartbeat)."""
    found: dict[str, set[str]] = {}
    for row in live_nodes(conn, max_silence_ms):
        if row.kind != "worker" or row.quiet_at is not None:
            continue
        try:
            queues = json.loads(row.info or "{}").get("queues", [])
        except (ValueError, AttributeError):
            continue
        found[row.node_id] = {q for q in queues if isinstance(q, str)}
    return found


def set_quiet(conn: Connection, name: str, quiet: bool, max_silence_ms: int) -> list[str]:
    """Ask the worker ``name`` to be quiet (``quiet_at`` set, kept if already set), or to
    resume (cleared); returns the names of the workers asked, sorted.

    ``name`` is a live worker's node name, or a supervisor's (``ax-worker --processes N
    -n NAME``): the supervisor has no row of its own, so its live children ``NAME.1`` …
    ``NAME.N`` are asked. A worker takes the change at its next heartbeat.

    Raises:
        ValidationError: no live worker of that name (unknown, stopped, silent past
            ``max_silence_ms``, or a scheduler), nor children of a supervisor of it.
    """
    now = db_now_ms(conn)
    live = {r.node_id: r.kind for r in live_nodes(conn, max_silence_ms)}
    if name in live:
        if live[name] != "worker":
            raise ValidationError(f"{name!r} is a {live[name]}, not a worker")
        names = [name]
    else:
        names = sorted(n for n, kind in live.items() if kind == "worker"
                       and n.startswith(f"{name}.") and n[len(name) + 1:].isdigit())
    if not names:
        raise ValidationError(f"no live worker named {name!r} (see ax workers)")
    quiet_at: Any = func.coalesce(nodes.c.quiet_at, now) if quiet else None
    conn.execute(update(nodes).where(nodes.c.node_id.in_(names), nodes.c.stopped_at.is_(None))
                 .values(quiet_at=quiet_at))
    return names


def consumed_queues(conn: Connection, max_silence_ms: int) -> set[str]:
    """The queue names some live worker consumes (from the ``queues`` in its heartbeat)."""
    return set().union(*_worker_queues(conn, max_silence_ms).values())


def workers_consuming(conn: Connection, queue: str, max_silence_ms: int) -> list[str]:
    """The live workers that consume ``queue`` and a queue of their own, by name."""
    return sorted(node for node, queues in _worker_queues(conn, max_silence_ms).items()
                  if queue in queues and worker_queue(node) in queues)


__all__ = ["HOST_ID_KEY", "Heartbeat", "TakeOver", "claim_dead", "consumed_queues",
           "default_node_id", "host_identity", "live_names", "live_nodes", "pid_running", "prune_stopped",
           "same_pid_space", "set_quiet", "workers_consuming"]
