"""Running a scheduler in a thread, and a plain Kombu consumer that records what arrives."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kombu import Consumer, Queue

from ax_kombu.broker.connection import connection, task_queues
from ax_kombu.config import Settings
from ax_kombu.scheduler.node import Scheduler
from ax_kombu.store import Store
from ax_kombu.store.nodes import Heartbeat

from ..waiting import eventually, wait_until

__all__ = ["Collector", "Received", "Starter", "collecting", "consume", "eventually",
           "scheduler_running", "starting", "task_row"]


def task_row(task_id: int, trigger_time: int, status: str = "DELAYED",
             fingerprint: str | None = None, node: str | None = None,
             node_column: str = "owner_node") -> dict[str, Any]:
    """A complete ``ax_task`` row, of the columns every revision since 0011 has, for a test
    that writes below ``ax.enqueue`` (as an older revision or an older writer left it):
    type ``t``, processor ``t``, the fingerprint the id in hex unless given, ``node`` as
    ``owner_node`` (``node_column``: ``last_run_node`` before migration 0021; the column
    is left out when neither is given)."""
    return {"task_id": task_id, "task_type": "t", "trigger_time": trigger_time,
            "status": status, "priority": "default", "retry_count": 0, "max_retry": 0,
            "timeout_ms": 1000, "payload": "{}", "processor_name": "t", "callback_url": None,
            "biz_key": None, "fingerprint": fingerprint or f"{task_id:032x}", "trace_id": "x",
            "attempt": 0, "created_at": 1, "runner": "ax", "redispatches": 0, "gated": False,
            **({node_column: node} if node is not None or node_column != "owner_node" else {})}


def consume(settings: Settings, queues: list[Queue], expected: int,
            timeout: float = 20.0) -> list[Any]:
    """The messages on ``queues``, each acked, read by a plain Kombu consumer until
    ``expected`` came or ``timeout`` seconds passed (``message.payload`` is the body)."""
    got: list[Any] = []
    with connection(settings) as conn:
        def on_message(_body: Any, message: Any) -> None:
            got.append(message)
            message.ack()

        with Consumer(conn, queues=queues, callbacks=[on_message], accept=["json"]):
            deadline = time.monotonic() + timeout
            while len(got) < expected and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
    return got


@dataclass
class Received:
    queue: str
    body: dict[str, Any]
    at_ms: int
    #: the broker delivered this message before (its ack was lost with the connection)
    redelivered: bool = False


@dataclass
class Collector:
    """A plain Kombu consumer on the three queues, in a thread."""

    settings: Settings
    on_message: Callable[[Received], None] | None = None
    got: list[Received] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)
    _heartbeat: Heartbeat | None = None

    def run(self) -> None:
        """Consume until stopped; reconnect when the broker goes away (restart tests)."""
        while not self._stop.is_set():
            try:
                self._consume()
            except Exception:  # noqa: BLE001 - broker restarting: try again
                self._stop.wait(0.2)
        if self._heartbeat is not None:
            self._heartbeat.store.close()

    def _consume(self) -> None:
        heartbeat = self._register()
        with connection(self.settings) as conn:
            def handle(body: Any, message: Any) -> None:
                item = Received(message.delivery_info["routing_key"], body,
                                time.time_ns() // 1_000_000,
                                bool(message.delivery_info.get("redelivered")))
                if self.on_message is not None:
                    self.on_message(item)
                self.got.append(item)
                message.ack()

            queues = list(task_queues(self.settings).values())
            with Consumer(conn, queues=queues, callbacks=[handle], accept=["json"]):
                self._ready.set()
                beat_at = 0.0
                while not self._stop.is_set():
                    if time.monotonic() - beat_at >= 0.2:  # not one write per message
                        heartbeat.beat({"queues": self.queue_names()})
                        beat_at = time.monotonic()
                    try:
                        conn.drain_events(timeout=0.2)
                    except TimeoutError:
                        pass
            heartbeat.stop()

    def queue_names(self) -> list[str]:
        return [q.name for q in task_queues(self.settings).values()]

    def _register(self) -> Heartbeat:
        """Stand in for a worker: schedulers re-dispatch only to queues a live worker
        reports consuming in its heartbeat."""
        if self._heartbeat is None:
            self._heartbeat = Heartbeat(Store(self.settings), f"collector-{id(self)}", "worker")
        self._heartbeat.register({"queues": self.queue_names()})
        return self._heartbeat

    def ids(self) -> list[int]:
        return [r.body["task_id"] for r in self.got]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
        return bool(wait_until(predicate, timeout, 0.02))


class Starter:
    """Plays the worker's half of the contract for what a Collector receives:
    DISPATCHING → RUNNING fenced by the message's attempt, written in batches."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.pending: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def __call__(self, item: Received) -> None:
        with self.lock:
            self.pending.append((item.body["task_id"], item.body["attempt"]))

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.flush()
        self.flush()

    def flush(self) -> None:
        from collections import defaultdict

        from ax_kombu.core.states import Status
        from ax_kombu.store.transitions import transition

        with self.lock:
            batch, self.pending = self.pending, []
        by_attempt: dict[int, list[int]] = defaultdict(list)
        for task_id, attempt in batch:
            by_attempt[attempt].append(task_id)
        if by_attempt:
            with self.engine.begin() as conn:
                for attempt, ids in by_attempt.items():
                    transition(conn, ids, [Status.DISPATCHING], Status.RUNNING, attempt=attempt)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@contextmanager
def starting(engine: Any) -> Iterator[Starter]:
    starter = Starter(engine)
    try:
        yield starter
    finally:
        starter.close()


@contextmanager
def collecting(settings: Settings, on_message: Callable[[Received], None] | None = None
               ) -> Iterator[Collector]:
    collector = Collector(settings, on_message)
    thread = threading.Thread(target=collector.run, daemon=True)
    thread.start()
    assert collector._ready.wait(30), "consumer did not start"
    try:
        yield collector
    finally:
        collector._stop.set()
        thread.join(10)


@contextmanager
def scheduler_running(settings: Settings, node_id: str | None = None) -> Iterator[Scheduler]:
    scheduler = Scheduler(settings, node_id)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        yield scheduler
    finally:
        scheduler.request_stop()
        thread.join(30)
        assert not thread.is_alive(), "scheduler did not stop"
