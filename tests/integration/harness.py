"""Running a scheduler in a thread, and a plain Kombu consumer that records what arrives."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kombu import Consumer

from ax_kombu.broker import connection, task_queues
from ax_kombu.config import Settings
from ax_kombu.scheduler import Scheduler


@dataclass
class Received:
    queue: str
    body: dict[str, Any]
    at_ms: int


@dataclass
class Collector:
    """A plain Kombu consumer on the three queues, in a thread."""

    settings: Settings
    on_message: Callable[[Received], None] | None = None
    got: list[Received] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with connection(self.settings) as conn:
            def handle(body: Any, message: Any) -> None:
                item = Received(message.delivery_info["routing_key"], body,
                                time.time_ns() // 1_000_000)
                if self.on_message is not None:
                    self.on_message(item)
                self.got.append(item)
                message.ack()

            queues = list(task_queues(self.settings).values())
            with Consumer(conn, queues=queues, callbacks=[handle], accept=["json"]):
                self._ready.set()
                while not self._stop.is_set():
                    try:
                        conn.drain_events(timeout=0.2)
                    except TimeoutError:
                        pass

    def ids(self) -> list[int]:
        return [r.body["task_id"] for r in self.got]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()


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
