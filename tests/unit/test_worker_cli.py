"""ax-worker's argument parsing (one-line errors, flags, AX_* variables) and ``ax status``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import update

from ax_kombu.api import Client
from ax_kombu.cli import main as cli_main
from ax_kombu.cli.worker import main, node_name, parse_concurrency
from ax_kombu.config import from_env
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.store import Store
from ax_kombu.store.nodes import Heartbeat
from ax_kombu.store.schema import tasks
from ax_kombu.worker.lanes import parse_queues


def test_concurrency_forms() -> None:
    assert parse_concurrency("high=2, slow=1") == {"pool_high": 2, "pool_slow": 1}
    assert parse_concurrency("4") == {"pool_high": 4, "pool_default": 4, "pool_slow": 4}
    assert parse_concurrency(None) == {}
    for bad in ("fast=2", "high=two", "high"):
        with pytest.raises(ConfigurationError, match="bad -c item"):
            parse_concurrency(bad)


def test_queues_by_priority_or_configured_name() -> None:
    settings = from_env({}, queue_slow="batch")
    assert parse_queues("slow,high,high", settings) == ["slow", "high"]
    assert parse_queues("batch", settings) == ["slow"]
    with pytest.raises(ConfigurationError, match="unknown queue 'urgent'"):
        parse_queues("urgent", settings)
    with pytest.raises(ConfigurationError, match="no queue"):
        parse_queues(" , ", settings)


def test_node_name_placeholders() -> None:
    assert node_name("w1@%h.%p") == f"w1@{os.uname().nodename}.{os.getpid()}"
    assert node_name(None) is None


@pytest.mark.parametrize("args,env,message", [
    (["-Q", "urgent"], {}, "ax: error: unknown queue 'urgent'"),
    (["-c", "high=0"], {}, "ax: error: pool_high must be positive"),
    ([], {"AX_WORKER_CONCURRENCY": "slow=x"}, "ax: error: bad -c item 'slow=x'"),
    (["-A", "no.such.module"], {}, "ax: error: cannot import processor module 'no.such.module'"),
    (["--prefetch-multiplier", "0"], {}, "ax: error: prefetch_multiplier must be positive"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(args: list[str], env: dict[str, str],
                                                  message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, args, env={"AX_DATABASE_URL": f"sqlite:///{tmp_path}/x.db",
                                                 **env})
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(message), result.output


def test_status_shows_live_nodes_tasks_and_no_password(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ax.db'}"
    store = Store(from_env({}, database_url=url))
    Heartbeat(store, "worker@h.1.abcd", "worker").register({
        "queues": ["high", "slow"], "pools": {"high": 8, "slow": 2},
        "free": {"high": 7, "slow": 0}, "backlog": {"high": 0, "slow": 3},
        "stuck": {"high": 0, "slow": 1}, "running": 2})
    Heartbeat(store, "scheduler@h.2.ef01", "scheduler").register(
        {"broker": "amqp://guest:s3cret@rabbit:5672/ax", "held": 12})
    gone = Heartbeat(store, "worker@gone", "worker")
    gone.register({})
    gone.stop()
    store.close()
    result = CliRunner().invoke(cli_main, ["--db", url, "status", "--no-broker",
                                           "--broker", "redis://:hunter2@r:6379/0"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "worker@h.1.abcd" in out and "scheduler@h.2.ef01" in out
    assert "worker@gone" not in out
    assert "high 7/8 free; slow 0/2 free, 3 waiting, 1 stuck" in out and "running 2" in out
    assert "CREATED 0" in out and "RUNNING 0" in out
    assert "s3cret" not in out and "hunter2" not in out and "***" in out
    data = json.loads(CliRunner().invoke(cli_main, ["--db", url, "status", "--no-broker",
                                                    "--json"]).output)
    assert [n["kind"] for n in data["nodes"]] == ["scheduler", "worker"]
    assert data["tasks"]["SUCCESS"] == 0


def test_start_up_objects_are_frozen_out_of_garbage_collection() -> None:
    """A full collection would walk every object built at start-up (a ~50 ms pause here)."""
    import gc

    from ax_kombu.cli.daemon import freeze_start_up_objects

    built_at_start_up = [{"slot": i} for i in range(1000)]
    try:
        freeze_start_up_objects()
        assert gc.get_freeze_count() >= len(built_at_start_up)
        assert not any(gc.is_tracked(o) and o in gc.get_objects(generation=2)
                       for o in built_at_start_up[:3])
    finally:
        gc.unfreeze()


def test_status_names_a_queue_without_consumer_and_what_waits_for_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ax.db'}"
    settings = from_env({}, database_url=url)
    store = Store(settings)
    Heartbeat(store, "worker@a", "worker").register({"queues": ["high", "default"]})
    store.close()
    client = Client(settings)
    ids = [int(client.enqueue("push", {"i": i}, priority="slow")) for i in range(3)]
    client.enqueue("push", {"other": 1}, priority="high")
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id.in_(ids[:2])).values(status="DISPATCHING"))
        conn.execute(update(tasks).where(tasks.c.task_id == ids[2]).values(status="READY"))
    client.close()
    result = CliRunner().invoke(cli_main, ["--db", url, "status", "--no-broker"])
    assert result.exit_code == 0, result.output
    assert "high 1  default 1  slow: no consumer, 3 waiting" in result.output


def test_status_shows_limits_and_what_waits_for_a_key_or_a_limit(tmp_path: Path) -> None:
    from ax_kombu.store import gates

    url = f"sqlite:///{tmp_path / 'ax.db'}"
    client = Client(from_env({}, database_url=url))
    client.set_limit("sms.send", 1)
    ids = [int(client.enqueue("sms.send", {"i": i})) for i in range(3)]
    with client.store.engine.begin() as conn:
        now = client.store.now_ms() + 10
        gates.claim_gated(conn, ids, "s0", now, now)  # one claimed, two parked
    client.close()
    result = CliRunner().invoke(cli_main, ["--db", url, "status", "--no-broker"])
    assert result.exit_code == 0, result.output
    assert "limits  sms.send 1" in result.output
    assert "waiting for an order key or a limit (READY, parked)  sms.send 2" in result.output


def test_status_shows_free_slots_the_oldest_overdue_task_and_the_recent_delay(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ax.db'}"
    settings = from_env({}, database_url=url)
    store = Store(settings)
    Heartbeat(store, "worker@a", "worker").register(
        {"queues": ["high", "default"], "free": {"high": 3, "default": 10}})
    store.close()
    client = Client(settings)
    now = client.store.now_ms()
    waiting = int(client.enqueue("push", {"w": 1}))
    sent = [int(client.enqueue("push", {"i": i})) for i in range(4)]
    with client.store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id == waiting)
                     .values(status="READY", trigger_time=now - 4_000))
        for i, task_id in enumerate(sent):  # dispatched 10, 20, 30, 40 ms late
            conn.execute(update(tasks).where(tasks.c.task_id == task_id).values(
                status="SUCCESS", trigger_time=now - 1_000, dispatched_at=now - 990 + 10 * i))
    client.close()
    result = CliRunner().invoke(cli_main, ["--db", url, "status", "--no-broker", "--json"])
    assert result.exit_code == 0, result.output
    view = json.loads(result.output)
    assert view["free_slots"] == {"high": 3, "default": 10, "slow": 0}
    assert 4.0 <= view["oldest_overdue_s"] < 10.0
    assert view["schedule_delay_5m"] == {"dispatches": 4, "p50_ms": 20, "p99_ms": 40}
    text = CliRunner().invoke(cli_main, ["--db", url, "status", "--no-broker"]).output
    assert "free    high 3  default 10  slow 0 slots" in text
    assert "p50 20 ms, p99 40 ms over 4 dispatches in 5 min" in text
