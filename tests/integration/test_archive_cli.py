"""``ax archive`` and ``AX_RETENTION``: the real console scripts against PostgreSQL (and one
SQLite run): what moves, what stays, the file, resuming after a stop or a kill, bad input."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Table, func, insert, select

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.core.ids import compose
from ax_kombu.scheduler.retention import Retention
from ax_kombu.store import Store
from ax_kombu.store.engine import db_now_ms, make_engine, migrate
from ax_kombu.store.schema import attempt_archive, attempts, task_archive, tasks

from ..waiting import eventually
from .ax_cli import Ax, ax_command

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DAY = 86_400_000
_made = itertools.count(1)


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    e = make_engine(pg_url)
    yield e
    e.dispose()


@pytest.fixture
def ax(pg_url: str) -> Ax:
    return Ax(pg_url)


def task(now: int, status: str, finished_ago: int | None, *, created_ago: int = 30 * DAY,
         task_type: str = "mail") -> dict[str, Any]:
    """A whole task row created ``created_ago`` ms before ``now``: its snowflake id carries
    that time, as ids made by ax do."""
    n = next(_made)
    created = now - created_ago - n  # one ms apart: ids stay unique
    return {"task_id": compose(created, 7, 0), "task_type": task_type, "trigger_time": created,
            "status": status, "priority": "default", "max_retry": 3, "timeout_ms": 60_000,
            "processor_name": task_type, "payload": json.dumps({"n": n}),
            "fingerprint": f"{n:032x}", "trace_id": f"{n:032x}", "attempt": 2,
            "owner_node": "w1", "created_at": created, "dispatched_at": created,
            "started_at": created + 1, "result": json.dumps({"ok": n}),
            "finished_at": None if finished_ago is None else now - finished_ago}


def attempt(task_id: int, number: int, outcome: str = "RETRY") -> dict[str, Any]:
    return {"task_id": task_id, "attempt": number, "task_type": "mail", "node": "w1",
            "trigger_time": 1, "dispatched_at": 2, "started_at": 3, "finished_at": 4,
            "outcome": outcome, "error": "boom", "duration_ms": 1}


def add(engine: Engine, rows: list[dict[str, Any]]) -> list[int]:
    with engine.begin() as conn:
        conn.execute(insert(tasks), rows)
    return [r["task_id"] for r in rows]


def now_ms(engine: Engine) -> int:
    with engine.connect() as conn:
        return db_now_ms(conn)


def rows(engine: Engine, table: Table) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(table).order_by(*table.primary_key))]


def count(engine: Engine, table: Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def state(engine: Engine) -> tuple[list[Any], ...]:
    return tuple(rows(engine, t) for t in (tasks, attempts, task_archive, attempt_archive))


def old_and_new(engine: Engine) -> dict[str, list[int]]:
    """Old finished tasks of each final status (some with attempts), and tasks that stay:
    finished recently, or old but not finished."""
    now = now_ms(engine)
    old = add(engine, [task(now, s, 10 * DAY) for s in ("SUCCESS", "FAILED", "CANCELLED") * 2])
    with engine.begin() as conn:
        conn.execute(insert(attempts), [attempt(old[0], 1), attempt(old[1], 1),
                                        attempt(old[1], 2, "FAILED")])
    recent = add(engine, [task(now, "SUCCESS", DAY), task(now, "FAILED", 6 * DAY)])
    active = add(engine, [task(now, s, None) for s in ("DELAYED", "READY", "RUNNING")])
    with engine.begin() as conn:
        conn.execute(insert(attempts), [attempt(recent[0], 1), attempt(active[2], 1)])
    return {"old": old, "recent": recent, "active": active}


def ids_of(found: list[tuple[Any, ...]]) -> list[int]:
    return sorted({r[0] for r in found})


# -- to the archive tables -----------------------------------------------------------------------

def test_old_finished_tasks_move_with_their_attempts_and_the_rest_stays(
        ax: Ax, engine: Engine, pg_url: str) -> None:
    made = old_and_new(engine)
    before = state(engine)
    hot_before, history_before, _, _ = before

    # stopped after 3 (--limit): each task in one place, the next run carries on
    first = ax.json("archive", "--older-than", "7d", "--batch", "2", "--limit", "3")
    assert (first["tasks"], first["batches"]) == (3, 2)
    hot, history, archived, archived_history = state(engine)
    assert len(archived) == 3 and sorted(hot + archived) == before[0]
    assert sorted(history + archived_history) == before[1]

    done = ax.json("archive", "--older-than", "7d", "--batch", "4")
    assert (first["attempts"] + done["attempts"], done["tasks"], done["batches"]) == (3, 3, 1)
    assert done["to"] == "ax_task_archive" and done["older_than_ms"] == 7 * DAY
    hot, history, archived, archived_history = state(engine)
    assert ids_of(hot) == sorted(made["recent"] + made["active"])
    assert archived == [r for r in hot_before if r[0] in made["old"]]  # every column, as it was
    assert archived_history == [r for r in history_before if r[0] in made["old"]]
    assert history == [r for r in history_before if r[0] not in made["old"]]

    assert ax.json("archive", "--older-than", "5d")["tasks"] == 1  # the one finished 6 d ago
    assert state(engine)[2] == [r for r in hot_before
                                if r[0] in made["old"] or r[0] == made["recent"][1]]

    shown = ax.json("inspect", str(made["old"][1]))  # ax inspect finds it in the archive
    assert shown["archived"] is True and shown["status"] == "FAILED"
    assert [(a["attempt"], a["outcome"]) for a in shown["attempts"]] == [(1, "RETRY"),
                                                                         (2, "FAILED")]
    assert "archived: yes" in ax("inspect", str(made["old"][0])).stdout
    client = Client(from_env({}, database_url=pg_url))
    try:
        view = client.get(made["old"][2])
        original = next(r for r in hot_before if r[0] == made["old"][2])
        assert view.archived and view.result == json.loads(original[list(tasks.columns.keys()).index("result")])
        assert not client.get(made["active"][0]).archived
    finally:
        client.close()


def test_a_killed_run_loses_nothing_and_duplicates_nothing(ax: Ax, engine: Engine,
                                                           pg_url: str) -> None:
    now = now_ms(engine)
    ids = add(engine, [task(now, "SUCCESS", 10 * DAY) for _ in range(4000)])
    with engine.begin() as conn:
        conn.execute(insert(attempts), [attempt(i, 1) for i in ids[::2]])
    before = state(engine)

    proc = subprocess.Popen([*ax_command(), "archive", "--older-than", "7d", "--batch", "4"],
                            env={**_clean_env(), **ax.env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    eventually(lambda: count(engine, task_archive) >= 40, interval=0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL

    hot, history, archived, archived_history = state(engine)
    assert 0 < len(archived) < len(ids)
    assert sorted(hot + archived) == before[0]  # each task in exactly one place
    assert sorted(history + archived_history) == before[1]

    assert ax.json("archive", "--older-than", "7d")["tasks"] == len(hot)
    assert state(engine)[2] == before[0] and state(engine)[3] == before[1]
    assert count(engine, tasks) == count(engine, attempts) == 0


# -- to a file -----------------------------------------------------------------------------------

def read_lines(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_to_a_file_one_object_per_task_with_its_attempts(ax: Ax, engine: Engine,
                                                        tmp_path: Path) -> None:
    made = old_and_new(engine)
    hot_before, history_before, _, _ = state(engine)
    path = tmp_path / "archive.jsonl.gz"

    done = ax.json("archive", "--older-than", "7d", "--to", str(path), "--batch", "4")
    assert (done["tasks"], done["attempts"], done["to"]) == (6, 3, str(path))
    lines = read_lines(path)
    assert [t["task_id"] for t in lines] == sorted(made["old"])
    columns = [c.name for c in tasks.columns]
    for line, original in zip(lines, [r for r in hot_before if r[0] in made["old"]],
                              strict=True):
        as_stored = {**line, "payload": json.dumps(line["payload"]),
                     "result": json.dumps(line["result"])}
        assert tuple(as_stored[c] for c in columns) == original
        assert [tuple(a.values()) for a in line["attempts"]] == \
            [r for r in history_before if r[0] == line["task_id"]]
    assert ids_of(rows(engine, tasks)) == sorted(made["recent"] + made["active"])
    assert count(engine, task_archive) == count(engine, attempt_archive) == 0

    whole = gzip.compress(b'{"task_id": 1}\n' * 50)
    with open(path, "ab") as f:  # a crash in the middle of the next batch's write
        f.write(whole[:len(whole) // 2])
    with pytest.raises((EOFError, zlib.error, OSError)):
        read_lines(path)

    later = add(engine, [task(now_ms(engine), "SUCCESS", 8 * DAY)])
    assert ax.json("archive", "--older-than", "7d", "--to", str(path))["tasks"] == 1
    # the torn member cut off, the new batch appended
    assert [t["task_id"] for t in read_lines(path)] == sorted(made["old"]) + later


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (("--older-than", "xyz"), "not a duration"),
    (("--older-than", "7d", "--pause", "xyz"), "not a duration"),
    (("--older-than", "7d", "--limit", "0"), "--limit"),
    (("--older-than", "7d", "--to", "/nonexistent/dir/a.jsonl.gz"), "cannot open"),
    (("--older-than", "7d", "--to", "{not_gzip}"), "not a gzip JSONL file"),
])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(ax: Ax, engine: Engine,
                                                         tmp_path: Path, args: tuple[str, ...],
                                                         words: str) -> None:
    old_and_new(engine)
    not_gzip = tmp_path / "notes.txt"
    not_gzip.write_text("my notes\n")
    before = state(engine)
    line = ax.fails(2, "archive", *(a.format(not_gzip=not_gzip) for a in args))
    assert words in line
    assert state(engine) == before
    assert not_gzip.read_text() == "my notes\n"


# -- SQLite --------------------------------------------------------------------------------------

def test_archive_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ax.sqlite3'}"
    sqlite = make_engine(url)
    try:
        migrate(sqlite)
        made = old_and_new(sqlite)
        before = state(sqlite)
        assert Ax(url).json("archive", "--older-than", "7d", "--batch", "4")["attempts"] == 3
        hot, history, archived, archived_history = state(sqlite)
        assert ids_of(archived) == sorted(made["old"]) and len(archived_history) == 3
        assert sorted(hot + archived) == before[0]
        assert sorted(history + archived_history) == before[1]
        path = tmp_path / "a.jsonl.gz"
        assert Ax(url).json("archive", "--older-than", "2d", "--to", str(path))["tasks"] == 1
        assert [t["task_id"] for t in read_lines(path)] == [made["recent"][1]]
    finally:
        sqlite.dispose()


# -- AX_RETENTION --------------------------------------------------------------------------------

def test_two_retention_stages_at_once_move_each_task_once(engine: Engine, pg_url: str) -> None:
    now = now_ms(engine)
    ids = add(engine, [task(now, "SUCCESS", 10 * DAY) for _ in range(3000)])
    with engine.begin() as conn:
        conn.execute(insert(attempts), [attempt(i, 1) for i in ids[::3]])
    keep = add(engine, [task(now, "SUCCESS", DAY)])
    before = state(engine)
    settings = from_env({}, database_url=pg_url, retention=7 * DAY, retention_batch=50,
                        retention_interval_s=0.05, retention_pause_ms=5)
    stores = [Store(settings) for _ in range(2)]
    stages = [Retention(settings, s) for s in stores]
    try:
        for stage in stages:
            stage.start()
        eventually(lambda: count(engine, task_archive) == len(ids), interval=0.01)
    finally:
        for stage in stages:
            stage.stop()
        for stage in stages:
            stage.join(10)
        for s in stores:
            s.close()
    hot, history, archived, archived_history = state(engine)
    assert ids_of(hot) == keep
    assert sorted(hot + archived) == before[0]
    assert sorted(history + archived_history) == before[1]


def test_a_scheduler_with_ax_retention_archives(engine: Engine, pg_url: str,
                                               tmp_path: Path) -> None:
    now = now_ms(engine)
    old = add(engine, [task(now, "SUCCESS", 10 * DAY) for _ in range(5)])
    recent = add(engine, [task(now, "SUCCESS", DAY)])
    env = {"AX_DATABASE_URL": pg_url, "AX_BROKER_URL": f"ax+sqlite:///{tmp_path / 'b.sqlite3'}",
           "AX_RETENTION": "7d", "AX_RETENTION_INTERVAL_S": "0.1"}
    proc = subprocess.Popen([*_scheduler(), "-n", "retention-test"], env={**_clean_env(), **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        eventually(lambda: count(engine, task_archive) == len(old) or proc.poll() is not None,
                   interval=0.01)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert ids_of(rows(engine, tasks)) == recent

    bad = subprocess.run([*_scheduler()], env={**_clean_env(), **env, "AX_RETENTION": "xyz"},
                         capture_output=True, text=True, timeout=30, check=False)
    assert bad.returncode == 2
    assert "AX_RETENTION='xyz' is not a duration" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def _scheduler() -> list[str]:
    script = Path(sys.executable).parent / "ax-scheduler"
    return [str(script)] if script.exists() else [
        sys.executable, "-c", "from ax_kombu.cli.scheduler import main; main()"]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
