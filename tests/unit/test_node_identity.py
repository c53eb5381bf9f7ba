"""The same-host pid check of a node name's registration (:mod:`ax_kombu.store.nodes`).

A registration may take a name over at once from a process that is gone: same host,
and its pid no longer runs (or is this very process). Containers that share a host
name each have their own pid 1 and their own pids: the pid of a row written in another
container says nothing here. The check is trusted only when the row's recorded
:func:`~ax_kombu.store.nodes.host_identity` (boot id and pid namespace) is this
process's; otherwise the heartbeat's age alone decides. SQLite on a temporary file.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from ax_kombu.config import from_env
from ax_kombu.exceptions import NodeNameInUse
from ax_kombu.store import Store, nodes
from ax_kombu.store.nodes import HOST_ID_KEY, Heartbeat, host_identity, same_pid_space
from ax_kombu.store.schema import nodes as node_table

OTHER_CONTAINER = "5b1c2a9e-0000-4000-8000-000000000000/4026532999"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.db'}"))
    yield s
    s.close()


def gone_pid() -> int:
    """A pid that ran here a moment ago and runs no more."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def live_row(store: Store, name: str, **values: Any) -> None:
    """Register ``name`` in another (pretend) process: fresh heartbeat, then ``values``."""
    Heartbeat(store, name, "worker").register({"queues": ["high"]})
    info = values.pop("host_id", None)
    row = {"info": json.dumps({"queues": ["high"], **({HOST_ID_KEY: info} if info is not None
                                                      else {})})}
    with store.engine.begin() as conn:
        conn.execute(update(node_table).where(node_table.c.node_id == name)
                     .values(**row, **values))


def test_the_identity_is_the_boot_and_the_pid_namespace() -> None:
    if not Path("/proc/self/ns/pid").exists():
        pytest.skip("no /proc pid namespaces here")
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert host_identity() == f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    assert same_pid_space(json.dumps({HOST_ID_KEY: host_identity()}))
    for info in (json.dumps({HOST_ID_KEY: OTHER_CONTAINER}), "{}", None, "not json", "[]"):
        assert not same_pid_space(info)


def test_registration_and_beats_record_the_identity(store: Store) -> None:
    hb = Heartbeat(store, "w", "worker")
    hb.register({"queues": ["high"]})
    assert hb.beat({"queues": ["high"], "running": 1})
    with store.engine.connect() as conn:
        info = json.loads(conn.execute(node_table.select()).one().info)
    assert info == {"queues": ["high"], "running": 1, HOST_ID_KEY: host_identity()}


def test_pid_1_of_another_container_with_this_host_name_is_not_this_process(
        store: Store) -> None:
    """Two containers with one host name, both pid 1 (here: our own pid): the name's
    live holder in the other container is not taken for this process."""
    live_row(store, "w", pid=os.getpid(), host_id=OTHER_CONTAINER)
    with pytest.raises(NodeNameInUse, match="'w' is in use"):
        Heartbeat(store, "w", "worker").register({})


def test_a_pid_that_does_not_run_here_is_not_proof_in_another_container(store: Store) -> None:
    live_row(store, "w", pid=gone_pid(), host_id=OTHER_CONTAINER)
    with pytest.raises(NodeNameInUse):
        Heartbeat(store, "w", "worker").register({})


def test_a_row_without_an_identity_waits_for_its_heartbeat(store: Store) -> None:
    """A row written by an older version (no identity): the heartbeat decides."""
    live_row(store, "w", pid=gone_pid())
    with pytest.raises(NodeNameInUse):
        Heartbeat(store, "w", "worker").register({})
    with store.engine.begin() as conn:  # silent for longer than the window: free
        conn.execute(update(node_table).values(heartbeat_at=0))
    assert Heartbeat(store, "w", "worker").register({}).requeued == 0


def test_in_this_pid_space_a_gone_pid_frees_the_name_at_once(store: Store) -> None:
    if not host_identity():
        pytest.skip("no host identity here: the pid check is never trusted")
    live_row(store, "w", pid=gone_pid(), host_id=host_identity())
    hb = Heartbeat(store, "w", "worker")
    hb.register({})
    assert hb.beat({})


def test_in_this_pid_space_a_running_pid_keeps_the_name(store: Store) -> None:
    if not host_identity():
        pytest.skip("no host identity here: the pid check is never trusted")
    live_row(store, "w", pid=os.getppid(), host_id=host_identity())
    with pytest.raises(NodeNameInUse):
        Heartbeat(store, "w", "worker").register({})


def test_without_an_identity_here_no_pid_is_trusted(store: Store,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc cannot tell (not Linux, a locked-down /proc): heartbeats only."""
    live_row(store, "w", pid=gone_pid(), host_id="")
    monkeypatch.setattr(nodes, "host_identity", lambda: "")
    with pytest.raises(NodeNameInUse):
        Heartbeat(store, "w", "worker").register({})
