"""COPY through an asyncio driver's connection, from the sync code that writes tasks.

The async producer (:mod:`ax_kombu.aio`) runs :func:`ax_kombu.store.enqueue.write_tasks` on
the sync facade of an async connection (SQLAlchemy's ``run_sync``). A large write is a
COPY, which the facade does not offer; :func:`copy_async` drives the driver's own COPY (psycopg
3's ``AsyncCursor.copy``, or asyncpg's ``copy_to_table``) from inside that facade, where
SQLAlchemy's ``await_only`` awaits it on the event loop. Nothing here loads SQLAlchemy's
asyncio extension.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Sequence
from typing import Any

from sqlalchemy.util import await_only


def is_async(raw: Any) -> bool:
    """Whether ``raw`` (a driver connection) is an asyncio driver's (psycopg 3's
    ``AsyncConnection``, whose commit is a coroutine, or asyncpg's)."""
    return (inspect.iscoroutinefunction(getattr(raw, "commit", None))
            or hasattr(raw, "copy_to_table"))


def copy_async(raw: Any, sql: str, table: str, columns: Sequence[str], data: str) -> None:
    """COPY ``data`` (CSV) into ``table``'s ``columns`` through ``raw``, an asyncio driver's
    connection, in its current transaction; call it inside ``run_sync``."""
    await_only(_copy(raw, sql, table, columns, data))


async def _copy(raw: Any, sql: str, table: str, columns: Sequence[str], data: str) -> None:
    if hasattr(raw, "copy_to_table"):  # asyncpg
        await raw.copy_to_table(table, source=io.BytesIO(data.encode()), columns=list(columns),
                                format="csv")
        return
    async with raw.cursor() as cursor, cursor.copy(sql) as copy:
        await copy.write(data)
