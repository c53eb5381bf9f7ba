"""Id reservations: snowflake node ids reserved in the ``ax_id_lease`` table (an old name,
kept; see :mod:`ax_kombu.core.ids`).

A slot is taken with one conditional UPDATE on a slot whose reservation has ended
(on the database clock); on PostgreSQL the candidate row is locked with
``SKIP LOCKED`` so processes starting together take different slots without
waiting on each other. SQLite serialises writers, which gives the same.
"""

from __future__ import annotations

from sqlalchemy import Engine, select, update

from ax_kombu.exceptions import IdExhausted
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.schema import id_leases as L


class StoreReserver:
    """The :class:`ax_kombu.core.ids.Reserver` backed by the task store."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def acquire(self, owner: str, reservation_ms: int) -> tuple[int, int]:
        with self._engine.begin() as conn:
            now = db_now_ms(conn)
            candidate = (select(L.c.slot).where(L.c.lease_until < now)
                         .order_by(L.c.lease_until, L.c.slot).limit(1)
                         .with_for_update(skip_locked=True).scalar_subquery())
            slot = conn.execute(
                update(L).where(L.c.slot == candidate, L.c.lease_until < now)
                .values(owner=owner, lease_until=now + reservation_ms).returning(L.c.slot)
            ).scalar_one_or_none()
        if slot is None:
            raise IdExhausted("all 1024 snowflake node ids are reserved; "
                              "too many producer processes are alive at once")
        return int(slot), now + reservation_ms

    def renew(self, slot: int, owner: str, reservation_ms: int) -> int | None:
        with self._engine.begin() as conn:
            now = db_now_ms(conn)
            moved = conn.execute(
                update(L).where(L.c.slot == slot, L.c.owner == owner, L.c.lease_until > now)
                .values(lease_until=now + reservation_ms)).rowcount
        return now + reservation_ms if moved == 1 else None

    def release(self, slot: int, owner: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(update(L).where(L.c.slot == slot, L.c.owner == owner)
                         .values(owner=None, lease_until=0))
