"""The worker on real servers: PostgreSQL + Redis and PostgreSQL + RabbitMQ.

Tasks take the real dispatch path without the scheduler loop: enqueued with
the producer API, claimed with ``claims.claim`` and published with
``broker.Publisher``. The worker runs in-process in a thread (or, for the
signal test, as the ``ax-worker`` command).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest
from kombu import Producer
from prometheus_client import REGISTRY
from sqlalchemy import select, update

import ax_kombu as ax
from ax_kombu.api import Client, TaskView
from ax_kombu.broker.connection import connection, task_queues
from ax_kombu.broker.messages import TaskMessage
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import Settings, from_env, worker_queue
from ax_kombu.core.states import Status
from ax_kombu.scheduler.liveness import Liveness
from ax_kombu.store import claims, transitions
from ax_kombu.store.nodes import Heartbeat
from ax_kombu.store.schema import nodes, tasks
from ax_kombu.worker.lanes import ACK_AT_START_MS
from ax_kombu.worker.node import Worker
from ax_kombu.worker.processors import Context, Resolver

from .. import procs_worker
from ..loopback_http import serving
from .harness import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class Dispatch:
    """The scheduler's side, by hand: enqueue, claim, publish."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = Client(settings)
        self.publisher = Publisher(settings)

    def enqueue(self, task_type: str, payload: Any = None, **options: Any) -> int:
        task_id = int(self.client.enqueue(task_type, payload, **options))
        with self.client.store.engine.begin() as conn:
            transitions.transition(conn, [task_id], [Status.CREATED], Status.READY)
        return task_id

    def claim(self, task_ids: list[int]) -> list[TaskMessage]:
        now = self.client.store.now_ms()
        with self.client.store.engine.begin() as conn:
            rows = claims.claim(conn, task_ids, "scheduler@test", now, due_before=2**62)
        return [TaskMessage(task_id=r.task_id, attempt=r.attempt, task_type=r.task_type,
                            payload=json.loads(r.payload), trace_id=r.trace_id,
                            trigger_time=r.trigger_time, timeout_ms=r.timeout_ms,
                            priority=r.priority, retry_count=r.retry_count,
                            max_retry=r.max_retry, processor=r.processor_name,
                            callback_url=r.callback_url, dispatched_at=now,
                            node="scheduler@test") for r in rows]

    def publish(self, messages: list[TaskMessage]) -> None:
        assert self.publisher.publish(messages) == []

    def dispatch(self, task_ids: list[int]) -> list[TaskMessage]:
        messages = self.claim(task_ids)
        assert len(messages) == len(task_ids)
        self.publish(messages)
        return messages

    def view(self, task_id: int) -> TaskView:
        return self.client.get(task_id)

    def status(self, task_id: int) -> Status:
        return self.view(task_id).status

    def queue_depth(self, priority: str) -> int:
        with connection(self.settings) as conn:
            channel = conn.default_channel
            queue = task_queues(self.settings)[priority](channel)
            if conn.transport.driver_type == "redis":  # its passive declare ignores the prefix
                return int(channel._size(queue.name))
            return int(queue.queue_declare(passive=True).message_count)

    def close(self) -> None:
        self.publisher.close()
        self.client.close()


@pytest.fixture
def settings(pg_url: str, broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, retry_backoff_base_ms=300,
                    retry_backoff_max_ms=5000, retry_backoff_jitter=0.5,
                    heartbeat_interval_s=0.2, worker_grace_s=10, **broker)


@pytest.fixture(autouse=True)
def _release_hung_processors() -> Iterator[None]:
    procs_worker.release.clear()
    yield
    procs_worker.release.set()


@contextmanager
def running(settings: Settings, **kwargs: Any) -> Iterator[Worker]:
    """A worker consuming in a background thread; stopped warmly on exit."""
    kwargs.setdefault("resolver", Resolver(modules=["tests.procs_worker"],
                                           allow_hosts=settings.callback_allow_hosts.split(",")))
    worker = Worker(settings, **kwargs)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    eventually(worker.ready.is_set, what="worker consuming")
    try:
        yield worker
    finally:
        procs_worker.release.set()
        worker.request_stop()
        thread.join(30)
    assert not thread.is_alive() and codes == [0]


def test_success_is_recorded_with_the_run_columns(settings: Settings,
                                                  dispatch: Dispatch) -> None:
    ids = [dispatch.enqueue("t.noop", {"i": i}, priority=("high", "default", "slow")[i % 3])
           for i in range(12)]
    with running(settings) as worker:
        messages = dispatch.dispatch(ids)
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
        assert worker.stats["succeeded"] == 12 and worker.stats["started"] == 12
    for message in messages:
        view = dispatch.view(message.task_id)
        assert view.attempt == 1 and view.retry_count == 0 and view.last_error is None
        assert view.owner_node == worker.node_id
        assert view.dispatched_at is not None and view.started_at is not None
        assert view.finished_at is not None
        assert view.dispatched_at <= view.started_at <= view.finished_at
        ctx = procs_worker.contexts[message.task_id]
        assert (ctx.attempt, ctx.trace_id, ctx.trigger_time, ctx.task_type) == (
            1, message.trace_id, message.trigger_time, "t.noop")
        assert procs_worker.calls[message.task_id] == 1
    with dispatch.client.store.engine.connect() as conn:
        node = conn.execute(select(nodes).where(nodes.c.node_id == worker.node_id)).one()
    info = json.loads(node.info)
    assert node.kind == "worker" and node.stopped_at is not None
    # the three priority lanes, and the worker's own queue (shards="workers")
    assert info["pools"] == {"high": 8, "default": 16, "slow": 8, "own": 2}
    assert info["queues"] == [settings.queue_high, settings.queue_default, settings.queue_slow,
                              worker_queue(worker.node_id)]


def _retried(dispatch: Dispatch, task_id: int, count: int) -> bool:
    return dispatch.view(task_id).retry_count == count


def _due(dispatch: Dispatch, trigger_time: int) -> bool:
    return dispatch.client.store.now_ms() >= trigger_time


def test_failing_twice_then_succeeding_retries_with_backoff(settings: Settings,
                                                            dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.flaky", {"x": 1}, max_retry=3)
    delays = []
    with running(settings):
        for retry in range(2):
            dispatch.dispatch([task_id])
            eventually(partial(_retried, dispatch, task_id, retry + 1))
            view = dispatch.view(task_id)
            assert view.status is Status.DELAYED and view.owner_node is None
            assert view.last_error == f"RuntimeError: flaky failure #{retry + 1}"
            assert view.started_at is not None
            delays.append(view.trigger_time - view.started_at)
            # the scheduler's part: wait until it is due, then claim and publish it again
            eventually(partial(_due, dispatch, view.trigger_time))
        dispatch.dispatch([task_id])
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS)
    view = dispatch.view(task_id)
    assert (view.retry_count, view.attempt) == (2, 3)
    assert procs_worker.calls[task_id] == 3
    # base 300 ms, jitter 0.5: retry n waits 300·2ⁿ·[0.5, 1] after the failure
    assert 150 <= delays[0] <= 300 + 100
    assert 300 <= delays[1] <= 600 + 100


def test_a_stale_attempt_is_refused_acked_and_not_run(settings: Settings,
                                                      dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.noop")
    [first] = dispatch.claim([task_id])
    with dispatch.client.store.engine.begin() as conn:  # ack timeout: back to READY …
        transitions.transition(conn, [task_id], [Status.DISPATCHING], Status.READY)
    [second] = dispatch.claim([task_id])               # … and dispatched again
    assert (first.attempt, second.attempt) == (1, 2)
    with running(settings) as worker:
        dispatch.publish([first])
        eventually(lambda: worker.stats["refused_stale"] == 1)
        assert dispatch.status(task_id) is Status.DISPATCHING
        assert task_id not in procs_worker.calls
        dispatch.publish([second])
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS)
    assert procs_worker.calls[task_id] == 1
    assert dispatch.queue_depth("default") == 0  # acked: nothing came back on disconnect


def test_a_cancelled_task_is_not_run(settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.noop")
    messages = dispatch.claim([task_id])
    dispatch.client.cancel(task_id)
    with running(settings) as worker:
        dispatch.publish(messages)
        eventually(lambda: worker.stats["refused_cancelled"] == 1)
    assert dispatch.status(task_id) is Status.CANCELLED
    assert task_id not in procs_worker.calls
    assert dispatch.queue_depth("default") == 0


def test_a_staged_task_is_fenced_on_receipt_and_started_at_its_trigger_time(
        settings: Settings, dispatch: Dispatch) -> None:
    """Published ahead of its trigger time (as the scheduler stages it): RUNNING at once,
    started by the processor at its trigger time, never before; started_at is when it really
    started (the result records it), not when it was fenced."""
    ids = [dispatch.enqueue("t.noop", {"i": i}, delay=2.5) for i in range(5)]
    with running(settings):
        messages = dispatch.dispatch(ids)
        eventually(lambda: all(dispatch.status(i) is Status.RUNNING for i in ids))
        fenced_ms = dispatch.client.store.now_ms()
        assert all(fenced_ms < m.trigger_time for m in messages)  # fenced before it is due
        assert not any(i in procs_worker.calls for i in ids)       # and not started
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
    for message in messages:
        view = dispatch.view(message.task_id)
        assert view.started_at is not None and view.finished_at is not None
        assert message.trigger_time <= view.started_at <= view.finished_at
        assert procs_worker.calls[message.task_id] == 1
        # the processor's wall clock against the database's (same host): never early
        assert procs_worker.started_ms[message.task_id] >= message.trigger_time - 2


def test_a_staged_task_cancelled_before_its_trigger_time_is_not_run(
        settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.noop", delay=2.0)
    # no heartbeat (and so no heartbeat's cancellation check) before the trigger time
    with running(settings.replace(heartbeat_interval_s=10.0)) as worker:
        [message] = dispatch.dispatch([task_id])
        eventually(lambda: dispatch.status(task_id) is Status.RUNNING)
        dispatch.client.cancel(task_id)
        # the staged runs are checked every 50 ms: this one ends without starting
        eventually(lambda: not worker.intake.stage.runs, what="the staged run ended")
        assert dispatch.client.store.now_ms() < message.trigger_time
    assert dispatch.status(task_id) is Status.CANCELLED
    assert task_id not in procs_worker.calls


def test_a_stopping_worker_hands_its_held_staged_tasks_back_unstarted(
        settings: Settings, dispatch: Dispatch) -> None:
    ids = [dispatch.enqueue("t.noop", {"i": i}, delay=5.0) for i in range(3)]
    with running(settings) as worker:
        messages = dispatch.dispatch(ids)
        eventually(lambda: all(dispatch.status(i) is Status.RUNNING for i in ids))
    # the warm stop did not wait for the trigger time: they are back, unheld, as they were
    assert dispatch.client.store.now_ms() < min(m.trigger_time for m in messages)
    for message in messages:
        view = dispatch.view(message.task_id)
        assert (view.status, view.owner_node, view.attempt, view.retry_count) == (
            Status.DELAYED, None, 1, 0)
        assert view.trigger_time == message.trigger_time
    assert not any(i in procs_worker.calls for i in ids)
    assert worker.stats["handed_back"] == 3
    assert dispatch.queue_depth("default") == 0  # their messages were acked


def test_a_timeout_is_signalled_and_recorded_only_when_the_thread_returns(
        settings: Settings, dispatch: Dispatch) -> None:
    """A timed-out run is never retried while its thread still runs (no two copies at once)."""
    task_id = dispatch.enqueue("t.hang", timeout_ms=300, max_retry=3, priority="slow")
    with running(settings) as worker:
        lane = next(lane for lane in worker.lanes if lane.priority == "slow")
        dispatch.dispatch([task_id])
        eventually(lambda: lane.pool.overdue == 1, what="the run is overdue")
        ctx = procs_worker.contexts[task_id]
        assert ctx.cancelled is not None and ctx.cancelled.reason == "timeout"
        assert ctx.deadline is not None
        assert dispatch.status(task_id) is Status.RUNNING  # not retried while it runs
        assert lane.pool.free == lane.pool.size - 1 and lane.unacked == 1  # slot and message kept
        procs_worker.release.set()
        eventually(lambda: dispatch.status(task_id) is Status.DELAYED, what="retry scheduled")
        view = dispatch.view(task_id)
        assert view.last_error == "timed out after 300 ms" and view.retry_count == 1
        assert worker.stats["timed_out"] == 1 and lane.pool.overdue == 0
        eventually(lambda: lane.pool.free == lane.pool.size and lane.prefetch == lane.window,
                   what="slot and prefetch back")
    assert procs_worker.calls[task_id] == 1


def test_a_long_task_is_acked_at_start_and_its_slot_lowers_the_prefetch(
        settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.hang", timeout_ms=ACK_AT_START_MS + 1, priority="slow")
    with running(settings) as worker:
        lane = next(lane for lane in worker.lanes if lane.priority == "slow")
        dispatch.dispatch([task_id])
        eventually(lambda: dispatch.status(task_id) is Status.RUNNING and lane.pool.active == 1)
        # no message kept unacked for it (RabbitMQ closes a channel keeping one 30 min) …
        assert lane.unacked == 0 and lane.acked_running == 1
        # … so its slot is taken out of the prefetch instead
        eventually(lambda: lane.prefetch == lane.window - 1, what="prefetch lowered")
        procs_worker.release.set()
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS)
        eventually(lambda: lane.prefetch == lane.window and lane.acked_running == 0,
                   what="prefetch back")


def test_a_saturated_slow_pool_does_not_delay_high_priority_tasks(
        settings: Settings, dispatch: Dispatch) -> None:
    settings = settings.replace(pool_slow=2, pool_high=4)
    slow_s = 1.0
    slow = [dispatch.enqueue("t.sleep", {"s": slow_s, "i": i}, priority="slow")
            for i in range(4)]
    high = [dispatch.enqueue("t.noop", {"i": i}, priority="high") for i in range(8)]
    with running(settings):
        dispatch.dispatch(slow)
        eventually(lambda: sum(dispatch.status(i) is Status.RUNNING for i in slow) == 2)
        high_messages = dispatch.dispatch(high)
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in high))
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in slow), timeout=30)
    for message in high_messages:
        view = dispatch.view(message.task_id)
        assert view.started_at is not None
        # started long before a slow slot could have freed up
        assert view.started_at - message.dispatched_at < slow_s * 1000 / 4
    views = sorted((dispatch.view(i) for i in slow), key=lambda v: v.started_at or 0)
    first_done = min(v.finished_at or 0 for v in views[:2])
    assert all((v.started_at or 0) >= first_done - 5 for v in views[2:])  # bounded: 2 at a time


def test_a_task_that_cannot_start_goes_back_to_ready(settings: Settings,
                                                     dispatch: Dispatch) -> None:
    settings = settings.replace(pool_default=2, worker_stage_horizon_ms=0)  # no stage
    gate = threading.Event()
    ids = [dispatch.enqueue("t.sleep", {"s": 1.0, "i": i}) for i in range(2)]
    try:
        with running(settings) as worker:
            lane = next(lane for lane in worker.lanes if lane.priority == "default")
            # a slot taken behind the broker's back: the prefetch (2) exceeds what can start
            assert lane.pool.try_submit(lambda: gate.wait(10), lambda outcome: None)
            dispatch.dispatch(ids)
            eventually(lambda: worker.stats["handed_back"] == 1)
            gate.set()
            eventually(lambda: sorted(dispatch.status(i) for i in ids) ==
                       [Status.READY, Status.SUCCESS])
    finally:
        gate.set()
    back = next(dispatch.view(i) for i in ids if dispatch.status(i) is Status.READY)
    assert back.owner_node is None and back.started_at is None and back.attempt == 1
    assert dispatch.queue_depth("default") == 0


def test_a_refused_dotted_path_is_recorded_and_nothing_is_called(
        settings: Settings, dispatch: Dispatch, tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    refused = dispatch.enqueue("evil", f"touch {canary}", processor="os:system", max_retry=3)
    unknown = dispatch.enqueue("t.unknown", None, max_retry=0)
    allowed = dispatch.enqueue("calc", {"n": 21}, processor="tests.procs_worker:double")
    with running(settings):
        dispatch.dispatch([refused, unknown, allowed])
        eventually(lambda: {dispatch.status(i) for i in (refused, unknown, allowed)} ==
                   {Status.FAILED, Status.SUCCESS})
    view = dispatch.view(refused)
    assert view.status is Status.FAILED and view.retry_count == 0  # refusal is final
    assert "'os:system' refused" in (view.last_error or "")
    assert not canary.exists()
    assert "no processor 't.unknown'" in (dispatch.view(unknown).last_error or "")
    assert dispatch.status(allowed) is Status.SUCCESS


#: what the processors of the forged-message test were given, by processor
forgery_runs: dict[str, list[tuple[Any, Context]]] = {"stored": [], "forged": []}


@ax.processor("t.forgery.stored")
def _stored_processor(payload: Any, ctx: Context) -> None:
    forgery_runs["stored"].append((payload, ctx))
    raise RuntimeError("the stored processor fails, so its retry settings decide")


@ax.processor("t.forgery.forged")
def _forged_processor(payload: Any, ctx: Context) -> None:
    forgery_runs["forged"].append((payload, ctx))


def _forged_count() -> float:
    return REGISTRY.get_sample_value("ax_rejected_messages_total", {"reason": "forged"}) or 0.0


def test_a_forged_message_runs_the_stored_task_and_is_counted(
        settings: Settings, dispatch: Dispatch, caplog: pytest.LogCaptureFixture) -> None:
    """Anyone who can write to the broker can send "task X, attempt N" with another processor,
    payload, callback and settings: the worker runs what the row stores, and counts the
    forgery. The genuine message, arriving after, is refused (the task is no longer
    DISPATCHING) and nothing runs twice."""
    for runs in forgery_runs.values():
        runs.clear()
    task_id = dispatch.enqueue("t.forgery.stored", {"grant": "coupon-1"}, max_retry=2,
                               timeout_ms=7000, processor="t.forgery.stored")
    [genuine] = dispatch.claim([task_id])
    forged = genuine._replace(task_type="t.forgery.forged", payload={"grant": "everything"},
                              processor="t.forgery.forged", timeout_ms=1, max_retry=0,
                              retry_count=5, trace_id="forged-trace")
    before = _forged_count()
    with caplog.at_level(logging.WARNING), running(settings) as worker:
        dispatch.publish([forged])
        eventually(lambda: dispatch.view(task_id).retry_count == 1)
        dispatch.publish([genuine])
        eventually(lambda: worker.stats["refused_state"] == 1)
        assert worker.stats["forged"] == 1 and worker.stats["started"] == 1
    assert forgery_runs["forged"] == []
    [(payload, ctx)] = forgery_runs["stored"]
    assert payload == {"grant": "coupon-1"}
    assert (ctx.task_id, ctx.attempt, ctx.task_type, ctx.trace_id) == (
        task_id, 1, "t.forgery.stored", genuine.trace_id)
    assert (ctx.timeout_ms, ctx.max_retry, ctx.retry_count) == (7000, 2, 0)
    view = dispatch.view(task_id)  # failed with max_retry 2 (stored), not 0 (forged): a retry
    assert view.status is Status.DELAYED and view.retry_count == 1
    assert view.last_error == "RuntimeError: the stored processor fails, so its retry settings decide"
    assert _forged_count() == before + 1
    warnings = [r for r in caplog.records if r.getMessage().startswith(
        "message differs from the stored task")]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    extra = vars(warnings[0])
    assert extra["reason"] == "message differs from the stored task"
    assert extra["task_id"] == task_id
    # a version-2 message carries no payload, processor or settings: of what it claimed,
    # only its trace id reached the worker, and that differs from the row's
    assert set(extra["fields"]) == {"trace_id"}
    assert "everything" not in warnings[0].getMessage()


def test_a_stored_payload_that_is_not_json_fails_its_run_and_nothing_is_called(
        settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.noop", {"ok": 1}, max_retry=3)
    messages = dispatch.claim([task_id])
    with dispatch.client.store.engine.begin() as conn:  # a row edited by hand
        conn.execute(update(tasks).where(tasks.c.task_id == task_id).values(payload="{oops"))

    def row() -> Any:  # read by hand: the API cannot show that payload either
        with dispatch.client.store.engine.connect() as conn:
            return conn.execute(select(tasks.c.status, tasks.c.retry_count, tasks.c.last_error)
                                .where(tasks.c.task_id == task_id)).one()

    with running(settings):
        dispatch.publish(messages)
        eventually(lambda: row().status == Status.FAILED)
    failed = row()
    assert failed.retry_count == 0 and "stored payload is not JSON" in failed.last_error
    assert task_id not in procs_worker.calls


def test_a_non_json_message_is_dropped_and_the_worker_goes_on(settings: Settings,
                                                              dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.noop")
    with running(settings) as worker:
        with connection(settings) as conn:
            Producer(conn.default_channel).publish(
                {"v": 1, "task_id": task_id}, routing_key=settings.queue_default, exchange="",
                serializer="pickle")
        eventually(lambda: worker.stats["malformed"] == 1)
        dispatch.dispatch([task_id])
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS)


def _worker_command(settings: Settings, pg_url: str, stage_horizon_ms: int = 0,
                    multiplier: int = 2) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "AX_QUEUE_HIGH": settings.queue_high,
           "AX_WORKER_STAGE_HORIZON_MS": str(stage_horizon_ms),
           "AX_QUEUE_DEFAULT": settings.queue_default, "AX_QUEUE_SLOW": settings.queue_slow,
           "AX_BROKER_KEY_PREFIX": settings.broker_key_prefix, "AX_HEARTBEAT_INTERVAL_S": "0.1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "ax_kombu.cli.worker", "-Q", "slow", "-A",
               "tests.procs_worker", "-c", "slow=2", "--prefetch-multiplier", str(multiplier),
               "--db", pg_url, "--broker", settings.broker_url, "-l", "INFO"]
    return command, env


def _node_info(dispatch: Dispatch) -> dict[str, Any]:
    with dispatch.client.store.engine.connect() as conn:
        row = conn.execute(select(nodes.c.info).where(nodes.c.kind == "worker")).first()
    return {} if row is None else dict(json.loads(row.info))


@pytest.mark.timeout(120)
def _warm_stop_when_full(settings: Settings, dispatch: Dispatch, pg_url: str, ids: list[int],
                         **worker: int) -> tuple[str, dict[int, int]]:
    """Run an ``ax-worker -Q slow -c slow=2`` process, dispatch ``ids``, wait until it runs 2
    and holds 2 more (staged or in the backlog), SIGTERM it; returns its output and each
    task's attempt. It must exit 0."""
    command, env = _worker_command(settings, pg_url, **worker)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        eventually(lambda: bool(_node_info(dispatch)), what="worker heartbeat")
        attempts = {m.task_id: m.attempt for m in dispatch.dispatch(ids)}
        eventually(lambda: _node_info(dispatch).get("backlog", {}).get("slow") == 2
                   and _node_info(dispatch).get("running") == 2, what="pool and backlog full")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    return output, attempts


def test_warm_shutdown_on_sigterm_loses_nothing(settings: Settings, dispatch: Dispatch,
                                               pg_url: str) -> None:
    ids = [dispatch.enqueue("t.sleep", {"s": 0.8, "i": i}, priority="slow") for i in range(6)]
    # 2 running, 2 received into the backlog (multiplier 2, no stage), 2 left on the broker
    output, _ = _warm_stop_when_full(settings, dispatch, pg_url, ids)
    statuses = sorted(dispatch.status(i) for i in ids)
    assert statuses == [Status.DISPATCHING] * 2 + [Status.READY] * 2 + [Status.SUCCESS] * 2
    assert dispatch.queue_depth("slow") == 2  # the undelivered two are still on the broker
    for task_id in ids:
        if dispatch.status(task_id) is Status.READY:
            assert dispatch.view(task_id).owner_node is None
    assert "worker stopped" in output
    with dispatch.client.store.engine.connect() as conn:
        assert conn.execute(select(nodes.c.stopped_at)).scalar_one() is not None


def test_warm_shutdown_hands_staged_runs_back_without_starting_them(
        settings: Settings, dispatch: Dispatch, pg_url: str) -> None:
    ids = [dispatch.enqueue("t.sleep", {"s": 3.0, "i": i}, priority="slow") for i in range(6)]
    # 2 running, 2 fenced RUNNING and staged behind them (before any run was timed the stage
    # is one per thread), 2 left on the broker
    output, attempts = _warm_stop_when_full(settings, dispatch, pg_url, ids,
                                            stage_horizon_ms=1000, multiplier=1)
    statuses = sorted(dispatch.status(i) for i in ids)
    assert statuses == [Status.DELAYED] * 2 + [Status.DISPATCHING] * 2 + [Status.SUCCESS] * 2, (
        [str(s) for s in statuses], output)
    assert dispatch.queue_depth("slow") == 2  # the undelivered two are still on the broker
    for task_id in ids:
        view = dispatch.view(task_id)
        if view.status is Status.DELAYED:  # never started: same attempt, no retry counted
            assert view.owner_node is None and view.retry_count == 0
            assert view.attempt == attempts[task_id]
    assert "staged runs not started yet handed back" in output


class _Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append({"body": body, "trace": self.headers.get("X-Trace-Id")})
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_the_embedded_default_runs_processors_and_callbacks(tmp_path: Path) -> None:
    """SQLite store + ax's SQLite transport: no server at all (bar the callback's)."""
    settings = from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.db'}",
                        broker_url=f"ax+sqlite:///{tmp_path / 'broker.db'}",
                        callback_allow_hosts="127.0.0.1")  # the hook is on loopback
    _Hook.received = []
    dispatch = Dispatch(settings)
    try:
        with serving(_Hook) as hook:
            plain = [dispatch.enqueue("t.noop", {"i": i}) for i in range(20)]
            hooked = dispatch.enqueue("coupon.grant", {"user": 7}, callback_url=f"{hook}/h")
            with running(settings):
                dispatch.dispatch([*plain, hooked])
                eventually(lambda: all(dispatch.status(i) is Status.SUCCESS
                                       for i in [*plain, hooked]))
        view = dispatch.view(hooked)
        assert _Hook.received == [{"body": {"payload": {"user": 7}, "task_id": hooked,
                                            "attempt": 1, "trace_id": view.trace_id},
                                   "trace": view.trace_id}]
    finally:
        dispatch.close()


def test_the_worker_takes_from_the_broker_no_more_than_its_free_slots(
        settings: Settings, dispatch: Dispatch) -> None:
    settings = settings.replace(pool_default=2, worker_stage_horizon_ms=0)  # no stage
    ids = [dispatch.enqueue("t.hang", {"i": i}) for i in range(5)]
    with running(settings) as worker:
        dispatch.dispatch(ids)
        eventually(lambda: sum(dispatch.status(i) is Status.RUNNING for i in ids) == 2)
        lane = next(lane for lane in worker.lanes if lane.priority == "default")
        assert lane.unacked == 2 and dispatch.queue_depth("default") == 3  # the rest wait there
        procs_worker.release.set()
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
    assert dispatch.queue_depth("default") == 0


def test_the_worker_stages_no_more_than_its_stage_and_a_thread_takes_the_next_at_once(
        settings: Settings, dispatch: Dispatch) -> None:
    settings = settings.replace(pool_default=2)
    with running(settings) as worker:
        lane = next(lane for lane in worker.lanes if lane.priority == "default")
        window = lane.window  # 2 threads + what they finish in 1 s at the first guess
        assert window > 2
        ids = [dispatch.enqueue("t.hang", {"i": i}) for i in range(window + 5)]
        dispatch.dispatch(ids)
        # fenced RUNNING ahead of a free thread, up to the window; the rest wait in the broker
        eventually(lambda: sum(dispatch.status(i) is Status.RUNNING for i in ids) == window)
        assert lane.unacked == window and lane.pool.staged == window - 2
        assert dispatch.queue_depth("default") == 5
        assert sum(i in procs_worker.calls for i in ids) == 2  # staged is not started
        procs_worker.release.set()
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
    assert all(procs_worker.calls[i] == 1 for i in ids)


def test_a_backlog_is_not_taken_for_a_loss(settings: Settings, dispatch: Dispatch) -> None:
    """Messages still in the broker past the ack timeout are not dispatched again; once
    the queue has drained, a task still DISPATCHING is known lost and is."""
    store = dispatch.client.store
    Heartbeat(store, "w-live", "worker").register({"queues": [settings.queue_default]})
    scheduler = Heartbeat(store, "s-test", "scheduler")
    scheduler.register({})
    liveness = Liveness(settings, store, scheduler, dict, lambda: None, lambda: None)
    liveness._beating_since = store.now_ms() - settings.silence_ms  # may judge (trusted)
    ids = [dispatch.enqueue("t.noop", {"i": i}) for i in range(3)]
    attempts = {m.task_id: m.attempt for m in dispatch.dispatch(ids)}
    later = store.now_ms() + 10 * settings.ack_timeout_ms  # a backlog of minutes
    liveness.recover(later)
    assert all(dispatch.status(i) is Status.DISPATCHING for i in ids)
    assert {i: dispatch.view(i).attempt for i in ids} == attempts
    assert dispatch.queue_depth("default") == 3
    with connection(settings) as conn:  # the broker loses its data
        task_queues(settings)["default"](conn.default_channel).purge()
    liveness.recover(later)
    assert all(dispatch.status(i) is Status.READY for i in ids)


@pytest.mark.parametrize("pull", [True, False])
def test_redis_is_pulled_in_batches_unless_turned_off(settings: Settings, dispatch: Dispatch,
                                                      pull: bool) -> None:
    settings = settings.replace(redis_pull=pull)
    ids = [dispatch.enqueue("t.noop", {"i": i}) for i in range(20)]
    with running(settings) as worker:
        dispatch.dispatch(ids)
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
        pulled = [lane.pulled is not None for lane in worker.lanes]
        consumers = [lane.consumer is not None for lane in worker.lanes]
    expect_pull = pull and settings.broker_url.startswith("redis")
    lanes = len(worker.lanes)  # the three priorities and the worker's own queue
    assert lanes == 4 and pulled == [expect_pull] * lanes and consumers == [not expect_pull] * lanes


def test_a_start_whose_commit_reply_was_lost_still_runs_once(
        settings: Settings, dispatch: Dispatch, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RUNNING move commits but the worker sees an error (the connection broke after
    COMMIT): the retry must take the task as started by this worker, not refuse it and leave
    it RUNNING for ever."""
    from sqlalchemy.exc import OperationalError

    real_start = transitions.start_many
    lost: list[int] = []

    def start_reply_lost(conn: Any, pairs: Any, node: str, now_ms: int,
                         **kwargs: Any) -> list[transitions.Started]:
        if lost:
            return real_start(conn, pairs, node, now_ms, **kwargs)
        with dispatch.client.store.engine.begin() as own:  # commits, whatever happens to conn
            lost.extend(r.task_id for r in real_start(own, pairs, node, now_ms, **kwargs))
        raise OperationalError("COMMIT", {}, Exception("server closed the connection"))

    monkeypatch.setattr(transitions, "start_many", start_reply_lost)
    task_id = dispatch.enqueue("t.noop")
    with running(settings):
        dispatch.dispatch([task_id])
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS)
    assert lost == [task_id] and procs_worker.calls[task_id] == 1


def test_no_async_body_is_recorded_success_without_running(tmp_path: Path) -> None:
    """A plain processor that hands back a coroutine: FAILED with the reason, no retry, its
    body never ran; an ``async def`` by dotted path: awaited, SUCCESS once its body ran
    (procs_worker counts runs)."""
    settings = from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.db'}",
                        broker_url=f"ax+sqlite:///{tmp_path / 'broker.db'}")
    dispatch = Dispatch(settings)
    try:
        wrapped = [dispatch.enqueue("t.returns_coroutine", {"i": i}, max_retry=3)
                   for i in range(10)]
        dotted = [dispatch.enqueue("t.x", {"i": i}, processor="tests.procs_worker:async_dotted",
                                   max_retry=3) for i in range(10)]
        with running(settings):
            dispatch.dispatch([*wrapped, *dotted])
            eventually(lambda: all(dispatch.status(i) is Status.FAILED for i in wrapped)
                       and all(dispatch.status(i) is Status.SUCCESS for i in dotted))
        for task_id in wrapped:
            view = dispatch.view(task_id)
            assert view.retry_count == 0 and "an awaitable" in (view.last_error or "")
        assert not set(procs_worker.calls) & set(wrapped)
        assert all(procs_worker.calls.get(i) == 1 for i in dotted)
    finally:
        dispatch.close()
