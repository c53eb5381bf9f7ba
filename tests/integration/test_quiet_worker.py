"""A quiet worker in this process, on Redis and on RabbitMQ (issue 40): it hands its staged
run back (RUNNING → DELAYED, same attempt), finishes the running one, leaves what the
broker still holds there, stores its quiet with its next beat, and consumes again once
the stored quiet is cleared (as ``ax workers resume`` does)."""

from __future__ import annotations

from collections import Counter

import pytest
from sqlalchemy import select

from ax_kombu.config import Settings
from ax_kombu.core.states import Status
from ax_kombu.store.nodes import set_quiet
from ax_kombu.store.schema import nodes

from .harness import eventually
from .test_worker import Dispatch, running, settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

__all__ = ["settings"]  # a fixture, imported for pytest


def _statuses(dispatch: Dispatch, ids: list[int]) -> Counter[Status]:
    return Counter(dispatch.status(i) for i in ids)


def test_a_quiet_worker_hands_its_stage_back_and_consumes_again_after_resume(
        settings: Settings, dispatch: Dispatch) -> None:
    # one slow thread and a stage of one behind it: two messages out, two left on the broker
    one = settings.replace(pool_slow=1, worker_stage_horizon_ms=1000, prefetch_multiplier=1)
    ids = [dispatch.enqueue("t.sleep", {"s": 1.0, "i": i}, priority="slow") for i in range(4)]
    with running(one, queues=["slow"]) as worker:
        attempts = {m.task_id: m.attempt for m in dispatch.dispatch(ids)}
        eventually(lambda: worker.info()["running"] == 1 and worker.info()["backlog"]["slow"] == 1,
                   what="one running, one staged")
        worker.request_quiet()
        eventually(lambda: worker.consumer.quiet.active, what="quiet")
        eventually(lambda: _statuses(dispatch, ids) == Counter(
            {Status.SUCCESS: 1, Status.DELAYED: 1, Status.DISPATCHING: 2}),
            what="the running one done, the staged one handed back, two on the broker")
        assert dispatch.queue_depth("slow") == 2
        [staged] = [i for i in ids if dispatch.status(i) is Status.DELAYED]
        view = dispatch.view(staged)
        assert view.attempt == attempts[staged] and view.retry_count == 0
        assert view.owner_node is None
        engine = dispatch.client.store.engine

        def stored() -> bool:
            with engine.connect() as conn:
                return conn.execute(select(nodes.c.quiet_at).where(
                    nodes.c.node_id == worker.node_id)).scalar() is not None
        eventually(stored, what="the quiet stored by the beat")
        assert worker.info()["quiet"] is True and dispatch.queue_depth("slow") == 2
        left = [i for i in ids if dispatch.status(i) is Status.DISPATCHING]
        assert len(left) == 2
        with engine.begin() as conn:
            set_quiet(conn, worker.node_id, False, one.silence_ms)
        eventually(lambda: not worker.consumer.quiet.active, what="resumed")
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in left),
                   timeout=15, what="the broker's two run after the resume")
