"""Functions run in separate processes by the concurrency tests, and the context that
starts those processes."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext
from typing import Any


def context() -> BaseContext:
    """Processes forked from a server that imported ax once (``forkserver``): each child is a
    process of its own that shares nothing with the test's (no inherited connection, thread
    or lock), without importing ax again (a spawned interpreter takes about a second each)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.procs", "ax_kombu.api", "ax_kombu.store.claims",
                                "ax_kombu.store.engine"])
    return ctx


def enqueue_same(url: str, barrier: Any, out: Any) -> None:
    from ax_kombu.api import Client
    from ax_kombu.config import from_env

    client = Client(from_env({}, database_url=url))
    client.store.now_ms()  # warm the connection and clock before the race
    client.ids.next_ids(1)
    barrier.wait(timeout=60)
    task_id = client.enqueue("coupon.grant", {"user": 7, "coupon": "XMAS"}, delay=60)
    out.put((int(task_id), task_id.created))
    client.close()


def enqueue_biz(url: str, barrier: Any, out: Any, index: int) -> None:
    from ax_kombu.api import Client
    from ax_kombu.config import from_env

    client = Client(from_env({}, database_url=url))
    client.ids.next_ids(1)
    barrier.wait(timeout=60)
    task_id = client.enqueue("order.close", {"process": index}, delay=60, biz_key="order-42")
    out.put((int(task_id), task_id.created))
    client.close()


def claim_all(url: str, ids: list[int], prefix: str, barrier: Any, out: Any) -> None:
    import os
    import random

    from ax_kombu.store.claims import claim
    from ax_kombu.store.engine import make_engine

    node = f"{prefix}-{os.getpid()}"
    engine = make_engine(url)
    order = list(ids)
    random.Random(node).shuffle(order)  # overlapping batches in different orders
    won: list[int] = []
    barrier.wait(timeout=60)
    for start in range(0, len(order), 100):
        with engine.begin() as conn:
            rows = claim(conn, order[start:start + 100], node, now_ms=2**62)
        won.extend(r.task_id for r in rows)
    out.put((node, won))
    engine.dispose()


def make_ids(url: str, barrier: Any, out: Any) -> None:
    from ax_kombu.api import Client
    from ax_kombu.config import from_env

    client = Client(from_env({}, database_url=url))
    barrier.wait(timeout=60)
    ids: list[int] = []
    for _ in range(20):
        ids.extend(client.ids.next_ids(500))
    out.put(ids)
    client.close()
