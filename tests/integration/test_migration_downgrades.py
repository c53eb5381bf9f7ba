"""Migrations 0016 (``ax_due``), 0017 (the duplicate check's probe index), 0018
(``ax_task.armed`` no longer kept), 0019 (``ax_move``, ``released_key``) and 0020
(``ax_task.armed`` dropped, ``ax_node.held_runs`` renamed ``listed_runs``) taken back and
applied again on a database holding tasks:
each downgrade leaves the schema its previous revision made (the column ``ax_task.armed``
and then its stamp back, ``ax_due``'s table and triggers gone, 0015's hash index back), the duplicate check
keeps finding the stored tasks at every step, and upgrading again restores what the
schedulers and producers of this release read. On SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from alembic import command
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError

from ax_kombu.store.engine import alembic_config, current_revision, migrate
from ax_kombu.store.enqueue import insert_tasks

from .harness import task_row

pytestmark = [pytest.mark.timeout(120)]


def _downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def _indexes(engine: Engine) -> set[str]:
    return {i["name"] for i in inspect(engine).get_indexes("ax_fingerprint")}


def _triggers(engine: Engine) -> str:
    """The text of every trigger on ``ax_task``, as the database keeps it."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            return "\n".join(conn.execute(text(
                "SELECT pg_get_triggerdef(oid) || ' ' || pg_get_functiondef(tgfoid) "
                "FROM pg_trigger WHERE tgrelid = 'ax_task'::regclass AND NOT tgisinternal"
            )).scalars())
        return "\n".join(conn.execute(text(
            "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'ax_task'"
        )).scalars())


def _duplicates_found(engine: Engine, fresh_id: int) -> bool:
    """Does the check still see the stored task 1 (in a copy 1 s away) and let a new task
    (``fresh_id + 1``) in?"""
    got = insert_tasks(engine, [task_row(fresh_id, 10_001_000, "DELAYED", "a" * 32),
                                task_row(fresh_id + 1, 50_000_000, "DELAYED", f"{fresh_id:032x}")],
                       5_000)
    return [(w.task_id, w.created) for w in got] == [(1, False), (fresh_id + 1, True)]


def _armed(engine: Engine) -> tuple[bool, bool, list[Any]]:
    """Is ``ax_task.armed`` indexed, is it stamped by a trigger, and the stamps of the rows."""
    indexed = "ix_ax_task_armed" in {i["name"] for i in inspect(engine).get_indexes("ax_task")}
    triggers = _triggers(engine)
    stamped = ("ax_task_arm()" in triggers if engine.dialect.name == "postgresql"
               else "SET armed" in triggers)
    with engine.connect() as conn:
        stamps = list(conn.execute(text("SELECT armed FROM ax_task ORDER BY task_id")).scalars())
    return indexed, stamped, stamps


def _columns(engine: Engine, table: str) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns(table)}


def test_0020_0019_0018_0017_and_0016_go_back_and_come_again(empty_store: Engine) -> None:
    engine = empty_store
    postgres = engine.dialect.name == "postgresql"
    migrate(engine)
    insert_tasks(engine, [task_row(1, 10_000_000, "DELAYED", "a" * 32),
                          task_row(2, 20_000_000, "SUCCESS", "b" * 32)], 5_000)
    assert "armed" not in _columns(engine, "ax_task") | _columns(engine, "ax_task_archive")
    assert "listed_runs" in _columns(engine, "ax_node")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO ax_node (node_id, kind, host, pid, started_at, "
                          "heartbeat_at, listed_runs) VALUES ('w', 'worker', 'h', 1, 0, 0, ',1,')"))

    _downgrade(engine, "0019")
    assert current_revision(engine) == "0019"
    assert {"armed", "released_key"} <= _columns(engine, "ax_task_archive")
    assert "listed_runs" not in _columns(engine, "ax_node")
    with engine.connect() as conn:  # the renamed column kept its values
        assert conn.execute(text("SELECT held_runs FROM ax_node")).scalar() == ",1,"
    assert _armed(engine) == (False, False, [None, None])
    with engine.connect() as conn:  # the waiting task has its ax_due entry all the same
        assert conn.execute(text("SELECT task_id FROM ax_due")).scalars().all() == [1]

    _downgrade(engine, "0018")
    assert current_revision(engine) == "0018"
    assert "ax_move" not in inspect(engine).get_table_names()
    assert "released_key" not in {c["name"] for c in inspect(engine).get_columns("ax_task")}
    insert_tasks(engine, [task_row(5, 10_000_000, "DELAYED", "e" * 32)], 5_000)
    with engine.connect() as conn:  # ax_due's triggers outlived the dropped column
        assert conn.execute(text("SELECT task_id FROM ax_due ORDER BY task_id")
                            ).scalars().all() == [1, 5]

    _downgrade(engine, "0017")
    assert current_revision(engine) == "0017"
    insert_tasks(engine, [task_row(3, 30_000_000, "DELAYED", "c" * 32)], 5_000)
    indexed, stamped, stamps = _armed(engine)
    assert indexed and stamped and stamps[:2] == [None, None] and stamps[2] is not None
    assert _duplicates_found(engine, 40)

    _downgrade(engine, "0016")
    assert current_revision(engine) == "0016"
    if postgres:
        assert {"ix_ax_fingerprint_hash", "ix_ax_fingerprint_task"} <= _indexes(engine)
        assert "ix_ax_fingerprint_probe" not in _indexes(engine)
    assert _duplicates_found(engine, 10)

    _downgrade(engine, "0015")
    assert current_revision(engine) == "0015"
    assert "ax_due" not in inspect(engine).get_table_names()
    assert "ax_due" not in _triggers(engine)
    assert _duplicates_found(engine, 20)

    migrate(engine)
    assert current_revision(engine) == "0026"
    if postgres:
        assert "ix_ax_fingerprint_probe" in _indexes(engine)
        assert "ix_ax_fingerprint_hash" not in _indexes(engine)
    assert "armed" not in _columns(engine, "ax_task")
    assert "ax_task_arm()" not in _triggers(engine) and "SET armed" not in _triggers(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT listed_runs FROM ax_node")).scalar() == ",1,"
    with engine.connect() as conn:  # the waiting tasks got their entries back, the rest none
        due = sorted(conn.execute(text("SELECT task_id, trigger_time FROM ax_due")).all())
    assert [tuple(r) for r in due] == [(1, 10_000_000), (3, 30_000_000), (5, 10_000_000),
                                       (11, 50_000_000),
                                       (21, 50_000_000), (41, 50_000_000)]
    assert _duplicates_found(engine, 30)


def test_0022_trace_context_and_run_logs_go_back_and_come_again(empty_store: Engine) -> None:
    engine = empty_store
    migrate(engine)
    tables = set(inspect(engine).get_table_names())
    assert {"ax_run_log", "ax_run_log_archive"} <= tables
    for table in ("ax_task", "ax_task_archive"):
        assert {"traceparent", "tracestate"} <= _columns(engine, table)
    insert_tasks(engine, [task_row(1, 10_000_000, "DELAYED", "a" * 32)], 5_000)

    _downgrade(engine, "0021")
    assert current_revision(engine) == "0021"
    assert not {"ax_run_log", "ax_run_log_archive"} & set(inspect(engine).get_table_names())
    assert "traceparent" not in _columns(engine, "ax_task") | _columns(engine, "ax_task_archive")
    assert _duplicates_found(engine, 10)  # the stored task survived the dropped columns

    migrate(engine)
    assert current_revision(engine) == "0026"
    assert {"traceparent", "tracestate"} <= _columns(engine, "ax_task")


def test_0024_alerts_go_back_and_come_again(empty_store: Engine) -> None:
    engine = empty_store
    migrate(engine)
    assert "ax_alert" in inspect(engine).get_table_names()
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO ax_alert (task_type, on_failed, on_late, late_after_ms, webhook, "
            "secret, created_at, updated_at, checked_until, events) VALUES ('coupon.grant', "
            "true, false, NULL, 'https://hooks.example/a', 'whsec_x', 1, 1, 1, 0)"))
    insert_tasks(engine, [task_row(1, 10_000_000, "DELAYED", "a" * 32)], 5_000)

    _downgrade(engine, "0023")
    assert current_revision(engine) == "0023"
    assert "ax_alert" not in inspect(engine).get_table_names()
    assert _duplicates_found(engine, 10)  # the tasks are untouched

    migrate(engine)
    assert current_revision(engine) == "0026"
    with engine.connect() as conn:  # back, empty, and its checks in force
        assert conn.execute(text("SELECT count(*) FROM ax_alert")).scalar() == 0
    with pytest.raises(IntegrityError, match="(?i)check"), engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO ax_alert (task_type, on_failed, on_late, webhook, secret, "
            "created_at, updated_at, checked_until) VALUES ('t', false, false, 'https://h', "
            "'whsec_x', 1, 1, 1)"))


def test_0025_pauses_and_quiet_workers_go_back_and_come_again(empty_store: Engine) -> None:
    engine = empty_store
    migrate(engine)
    assert "ax_pause" in inspect(engine).get_table_names()
    assert "quiet_at" in _columns(engine, "ax_node")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO ax_pause (kind, name, paused_at, actor) "
                          "VALUES ('type', 'sms.send', 1, 'ops')"))
    insert_tasks(engine, [task_row(1, 10_000_000, "DELAYED", "a" * 32)], 5_000)

    _downgrade(engine, "0024")
    assert current_revision(engine) == "0024"
    assert "ax_pause" not in inspect(engine).get_table_names()
    assert "quiet_at" not in _columns(engine, "ax_node")
    assert _duplicates_found(engine, 10)  # the tasks are untouched

    migrate(engine)
    assert current_revision(engine) == "0026"
    with pytest.raises(IntegrityError, match="(?i)check"), engine.begin() as conn:
        conn.execute(text("INSERT INTO ax_pause (kind, name, paused_at, actor) "
                          "VALUES ('lane', 'x', 1, 'ops')"))


def test_0026_alert_outbox_goes_back_and_comes_again(empty_store: Engine) -> None:
    engine = empty_store
    migrate(engine)
    assert {"outbox", "outbox_claimed_until"} <= _columns(engine, "ax_alert")
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO ax_alert (task_type, on_failed, on_late, webhook, secret, "
            "created_at, updated_at, checked_until, events, outbox, outbox_claimed_until) "
            "VALUES ('coupon.grant', true, false, 'https://hooks.example/a', 'whsec_x', 1, "
            "1, 1, 0, '[{\"id\":\"msg_1\"}]', 5)"))

    _downgrade(engine, "0025")
    assert current_revision(engine) == "0025"
    assert not {"outbox", "outbox_claimed_until"} & _columns(engine, "ax_alert")
    with engine.connect() as conn:  # the alert itself is kept
        assert conn.execute(text("SELECT task_type FROM ax_alert")).scalar() == "coupon.grant"

    migrate(engine)
    assert current_revision(engine) == "0026"
    with engine.connect() as conn:  # back, empty
        row = conn.execute(text("SELECT outbox, outbox_claimed_until FROM ax_alert")).one()
    assert tuple(row) == (None, None)
