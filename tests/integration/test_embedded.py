"""The embedded default: a SQLite store and ax's SQLite Kombu transport, no server at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from ax_kombu.api import Client
from ax_kombu.config import from_env

from .harness import collecting, scheduler_running, starting

pytestmark = pytest.mark.timeout(120)


def test_scheduler_dispatches_on_the_embedded_default(tmp_path: Path) -> None:
    cfg = from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.sqlite3'}",
                   broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}",
                   heartbeat_interval_s=0.5)
    client = Client(cfg)
    ids = client.enqueue_many([{"task_type": "t", "payload": {"i": i}, "delay": i / 100,
                                "priority": ("high", "default", "slow")[i % 3]}
                               for i in range(300)])
    with starting(client.store.engine) as start, collecting(cfg, start) as got, \
            scheduler_running(cfg):
        assert got.wait_for(lambda: len(got.got) >= 100)
        # due inside the window already loaded: SQLite has no NOTIFY, the 50 ms poll finds it
        late = client.enqueue("t", {"late": True}, delay=0.2)
        assert got.wait_for(lambda: len(got.got) == 301)
    assert sorted(got.ids()) == sorted([int(i) for i in ids] + [int(late)])
    for received in got.got:
        assert received.queue == cfg.queue_for(received.body["priority"])
        # staged: never more than the claim lead and window early (5 ms clock tolerance)
        assert received.at_ms >= received.body["trigger_time"] - cfg.claim_reach_ms - 5
    client.close()
