"""Migration 0021: ``last_run_node`` splits into ``owner_node`` and ``parked`` and comes back,
on SQLite and PostgreSQL: rows move over as they are, the ``ax_due`` triggers keep their
effect on the new columns (a wake from parked writes an entry; parking or owning does not),
and the downgrade puts the marker back where a task was parked."""

from __future__ import annotations

import functools

import pytest
from alembic import command
from sqlalchemy import Engine, inspect, text

from ax_kombu.store.engine import alembic_config, current_revision, migrate

from .harness import task_row

pytestmark = [pytest.mark.timeout(120)]

old_row = functools.partial(task_row, node_column="last_run_node")


def _downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def _insert(engine: Engine, rows: list[dict[str, object]]) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO ax_task ({', '.join(rows[0])}) VALUES "
                          f"({', '.join(':' + k for k in rows[0])})"), rows)


def _query(engine: Engine, sql: str) -> list[tuple[object, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def _entries(engine: Engine, task_id: int) -> int:
    return len(_query(engine, f"SELECT task_id FROM ax_due WHERE task_id = {task_id}"))


def test_0021_splits_the_column_and_takes_it_back(empty_store: Engine) -> None:
    engine = empty_store
    migrate(engine, "0020")
    _insert(engine, [old_row(1, 5_000, "READY", node="~parked"),
                     old_row(2, 6_000, "RUNNING", node="w1"),
                     old_row(3, 7_000, "DELAYED", node=None)])
    migrate(engine)
    assert current_revision(engine) == "0026"
    for table in ("ax_task", "ax_task_archive"):
        columns = {c["name"] for c in inspect(engine).get_columns(table)}
        assert {"owner_node", "parked"} <= columns and "last_run_node" not in columns
    assert _query(engine, "SELECT task_id, owner_node, parked FROM ax_task ORDER BY task_id") \
        == [(1, None, True), (2, "w1", False), (3, None, False)]

    before = _entries(engine, 1)
    with engine.begin() as conn:  # woken: an entry; parked again and owned: none
        conn.execute(text("UPDATE ax_task SET parked = false WHERE task_id = 1"))
    assert _entries(engine, 1) == before + 1
    with engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET parked = true WHERE task_id = 1"))
        conn.execute(text("UPDATE ax_task SET owner_node = 's1' WHERE task_id = 3"))
    assert _entries(engine, 1) == before + 1
    _insert(engine, [{**task_row(4, 8_000, "READY"), "parked": True},
                     {**task_row(5, 9_000, "DELAYED"), "parked": False}])
    assert (_entries(engine, 4), _entries(engine, 5)) == (0, 1)  # inserted parked: none

    _downgrade(engine, "0020")
    assert current_revision(engine) == "0020"
    assert _query(engine, "SELECT task_id, last_run_node FROM ax_task ORDER BY task_id") == [
        (1, "~parked"), (2, "w1"), (3, "s1"), (4, "~parked"), (5, None)]
    with engine.begin() as conn:  # 0016's triggers are back on the marker
        conn.execute(text("UPDATE ax_task SET last_run_node = NULL WHERE task_id = 4"))
    assert _entries(engine, 4) == 1
    migrate(engine)
    assert _query(engine, "SELECT task_id, owner_node, parked FROM ax_task "
                          "WHERE task_id IN (1, 4) ORDER BY task_id") == [(1, None, True),
                                                                   (4, None, False)]
