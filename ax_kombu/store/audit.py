"""The record of operator actions (``ax_audit``, migration 0023): who changed what, when.

Every state-changing action of the console and of the CLI calls :func:`record` once,
after the action took effect: ``actor`` a console user's name (``token`` for the shared
token, ``local`` for an open loopback console) or the OS user (``ax --as NAME``
overrides it), ``via`` where it came from (:data:`VIA`), ``action`` a short verb
(``cancel``, ``retry``, ``run_now``, ``reschedule``, ``purge``, ``archive``,
``limit_set``, ``limit_clear``, ``job_pause``, ``job_resume``, ``job_run``,
``job_add``, ``job_remove``; new actions such as ``pause_type`` add their own),
``target`` what it acted on (``task:123``, ``job:nightly``, ``type:sms.send``, or a
selection like ``tasks:FAILED``), and ``detail`` a JSON object of the rest (counts, new
times, filters). ``at`` is the database clock, so rows from many hosts sort together.

The record is written in its own short transaction, after the action: a crash between
the two leaves an action without its row, never a row for an action that did not happen.

Retention: :func:`archive_before` moves rows older than a cutoff to ``ax_audit_archive``
(copy and delete in one transaction per batch, so a row is never lost or doubled);
``ax archive`` and ``AX_RETENTION`` call it with the tasks' cutoff
(:func:`ax_kombu.store.archive.archive_finished`).

Every function raises :class:`~ax_kombu.exceptions.StoreError` when the database fails.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from ax_kombu.exceptions import ValidationError
from ax_kombu.store.admin import _guarded
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.schema import audit, audit_archive

#: where an action came from
VIA = ("web", "cli", "api")
#: the most rows one read returns
READ_MAX = 10_000
#: rows moved to the archive per transaction
ARCHIVE_BATCH = 1000


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One recorded action; ``at`` epoch ms (database clock), ``detail`` None or a dict."""

    id: int
    at: int
    actor: str
    via: str
    action: str
    target: str
    detail: dict[str, Any] | None


def record(engine: Engine, *, actor: str, via: str, action: str, target: str,
           detail: Mapping[str, Any] | None = None) -> None:
    """Write one record, now (database clock), in a transaction of its own.

    Args:
        actor: who (cut to 128 characters).
        via: one of :data:`VIA`.
        action: a short verb, e.g. ``cancel``.
        target: what, e.g. ``task:123`` (cut to 256 characters).
        detail: anything else worth keeping, JSON-serialisable (non-JSON values as text).
    Raises:
        ValidationError: ``via`` is not one of :data:`VIA`, or ``actor`` or ``action`` is
            empty.
        StoreError: the database failed; nothing was written.
    """
    if via not in VIA:
        raise ValidationError(f"audit via must be one of {', '.join(VIA)}, not {via!r}")
    if not actor or not action:
        raise ValidationError("an audit record needs an actor and an action")
    text = None if detail is None else json.dumps(dict(detail), default=str,
                                                   ensure_ascii=False, sort_keys=True)

    def write() -> None:
        with engine.begin() as conn:
            conn.execute(audit.insert().values(at=db_now_ms(conn), actor=actor[:128], via=via,
                                               action=action[:64], target=target[:256],
                                               detail=text))
    _guarded(engine, write)


def read_since(engine: Engine, since_ms: int, *, limit: int = 500) -> list[Entry]:
    """The records at or after epoch ms ``since_ms``, newest first, at most ``limit``.

    Raises:
        ValidationError: ``limit`` is not 1 to :data:`READ_MAX`.
        StoreError: the database failed.
    """
    if not 1 <= limit <= READ_MAX:
        raise ValidationError(f"limit must be 1 to {READ_MAX}, not {limit}")

    def read() -> list[Entry]:
        with engine.connect() as conn:
            rows = conn.execute(select(audit).where(audit.c.at >= since_ms)
                                .order_by(audit.c.at.desc(), audit.c.id.desc()).limit(limit))
            return [_entry(r._mapping) for r in rows]
    return _guarded(engine, read)


def now_ms(engine: Engine) -> int:
    """The database clock (for ``--since`` windows on the same clock as ``at``)."""
    def read() -> int:
        with engine.connect() as conn:
            return db_now_ms(conn)
    return _guarded(engine, read)


def _entry(row: Any) -> Entry:
    detail = json.loads(row["detail"]) if row["detail"] else None
    return Entry(id=row["id"], at=row["at"], actor=row["actor"], via=row["via"],
                 action=row["action"], target=row["target"], detail=detail)


def archive_before(conn: Connection, cutoff_ms: int, batch: int = ARCHIVE_BATCH) -> int:
    """Move up to ``batch`` records older than ``cutoff_ms`` to ``ax_audit_archive`` in
    the caller's transaction (oldest first; on PostgreSQL rows another mover holds are
    skipped); returns how many moved (fewer than ``batch``: none older is left)."""
    stmt = (select(audit.c.id).where(audit.c.at < cutoff_ms)
            .order_by(audit.c.id).limit(batch))
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True)
    ids = [r[0] for r in conn.execute(stmt)]
    if ids:
        _copy(conn, ids)
        conn.execute(delete(audit).where(audit.c.id.in_(ids)))
    return len(ids)


def _copy(conn: Connection, ids: Sequence[int]) -> None:
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    names = [c.name for c in audit_archive.columns]
    rows = select(*(audit.c[n] for n in names)).where(audit.c.id.in_(list(ids)))
    conn.execute(insert(audit_archive).from_select(names, rows).on_conflict_do_nothing())
