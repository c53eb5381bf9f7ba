"""SIGTSTP to an ``ax-worker --processes 2`` supervisor quiets both children (real
processes on PostgreSQL and Redis): each stores its quiet and says so in its heartbeat,
none is suspended (they go on beating), and ``ax workers resume`` with the supervisor's
name resumes both."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from ax_kombu.worker.supervisor import child_name

from ..e2e.system import System
from .ax_cli import Ax

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(90)]

NAME = "wq"
CHILDREN = (child_name(NAME, 1), child_name(NAME, 2))


@pytest.fixture
def system(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    s = System(pg_url, redis_broker, tmp_path, env={"heartbeat_interval_s": 0.3,
                                                    "heartbeat_misses": 10})
    yield s
    s.close()


def _states(system: System) -> dict[str, tuple[bool, bool]]:
    """Each child's (quiet_at set, heartbeat says quiet)."""
    return {r.node_id: (r.quiet_at is not None, bool(json.loads(r.info).get("quiet")))
            for r in system.query("SELECT node_id, quiet_at, info FROM ax_node "
                                  "WHERE node_id LIKE 'wq.%' AND stopped_at IS NULL")}


def test_sigtstp_to_the_supervisor_quiets_every_child(system: System) -> None:
    supervisor = system.worker(NAME, concurrency="high=1,default=1,slow=1",
                               args=["--processes", "2"])
    system.wait_for(lambda: set(CHILDREN) <= system.live_nodes(), 60, "both children registered")
    system.signal(supervisor, signal.SIGTSTP)
    system.wait_for(lambda: _states(system) == dict.fromkeys(CHILDREN, (True, True)), 15,
                    "both children quiet", detail=lambda: _states(system))
    beats = {n: system.node(n).heartbeat_at for n in CHILDREN}
    system.wait_for(lambda: all(system.node(n).heartbeat_at > beats[n] for n in CHILDREN), 5,
                    "the quiet children beating")
    assert supervisor.alive
    assert "wq.1: resumed" in Ax(system.database_url).ok("workers", "resume", NAME)
    system.wait_for(lambda: _states(system) == dict.fromkeys(CHILDREN, (False, False)), 15,
                    "both children resumed", detail=lambda: _states(system))
