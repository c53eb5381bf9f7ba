"""Helpers the benchmarks share: a scratch PostgreSQL database, percentiles, machine info."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy import text

from ax_kombu.store.engine import make_engine, migrate

PG_ADMIN = os.environ.get("AX_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def scratch_database(name: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database, dropped afterwards."""
    admin = make_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    engine = make_engine(url)
    migrate(engine)
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"
