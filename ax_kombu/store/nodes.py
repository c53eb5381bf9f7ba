"""Liveness of scheduler and worker processes: one ``ax_node`` row each, heartbeated.

A node is *dead* when it has not written a heartbeat for
``heartbeat_misses × heartbeat_interval_s`` and did not stop cleanly. Whoever
notices first marks it stopped with a compare-and-set, so the tasks it held
are recovered exactly once (see the scheduler's recovery).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, Row, delete, insert, select, update

from ax_kombu.store import Store
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.schema import nodes


def default_node_id(kind: str) -> str:
    """``kind@host.pid.xxxx``: unique even when a pid is reused."""
    return f"{kind}@{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:4]}"


class Heartbeat:
    """Registers one process in ``ax_node`` and keeps its heartbeat fresh."""

    def __init__(self, store: Store, node_id: str, kind: str) -> None:
        self.store = store
        self.node_id = node_id
        self.kind = kind

    def register(self, info: Mapping[str, Any]) -> None:
        now = self.store.now_ms()
        with self.store.engine.begin() as conn:
            conn.execute(delete(nodes).where(nodes.c.node_id == self.node_id))
            conn.execute(insert(nodes).values(
                node_id=self.node_id, kind=self.kind, host=socket.gethostname(), pid=os.getpid(),
                started_at=now, heartbeat_at=now, info=json.dumps(dict(info))))

    def beat(self, info: Mapping[str, Any]) -> None:
        with self.store.engine.begin() as conn:
            conn.execute(update(nodes).where(nodes.c.node_id == self.node_id)
                         .values(heartbeat_at=self.store.now_ms(), info=json.dumps(dict(info))))

    def stop(self) -> None:
        with self.store.engine.begin() as conn:
            conn.execute(update(nodes).where(nodes.c.node_id == self.node_id)
                         .values(stopped_at=self.store.now_ms()))


def claim_dead(conn: Connection, max_silence_ms: int, kind: str | None = None) -> list[str]:
    """Mark nodes silent for longer than ``max_silence_ms`` as stopped; returns their ids.

    A node id is returned to exactly one caller, however many race.
    """
    now = db_now_ms(conn)
    stmt = (update(nodes)
            .where(nodes.c.stopped_at.is_(None), nodes.c.heartbeat_at < now - max_silence_ms)
            .values(stopped_at=now).returning(nodes.c.node_id))
    if kind is not None:
        stmt = stmt.where(nodes.c.kind == kind)
    return [r[0] for r in conn.execute(stmt)]


def live_nodes(conn: Connection, max_silence_ms: int) -> list[Row[Any]]:
    """Rows of nodes that have heartbeated within ``max_silence_ms`` and not stopped."""
    now = db_now_ms(conn)
    return list(conn.execute(select(nodes).where(
        nodes.c.stopped_at.is_(None), nodes.c.heartbeat_at >= now - max_silence_ms)
        .order_by(nodes.c.kind, nodes.c.node_id)))
