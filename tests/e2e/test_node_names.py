"""Node names across processes: a second live process under a name is refused at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from ax_kombu.config import from_env
from ax_kombu.store import Store
from ax_kombu.store.schema import nodes

from ..waiting import wait_until
from .system import stop_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _scheduler(tmp: Path, log: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
    env.update({"AX_DATABASE_URL": f"sqlite:///{tmp / 'ax.db'}",
                "AX_BROKER_URL": f"ax+sqlite:///{tmp / 'broker.db'}"})
    out = open(tmp / log, "wb")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen([sys.executable, "-c", "from ax_kombu.cli.scheduler import main; main()",
                             "-n", "s0"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)


def test_a_second_live_scheduler_with_the_same_name_is_refused(tmp_path: Path) -> None:
    first = _scheduler(tmp_path, "first.log")
    try:
        store = Store(from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.db'}"))

        def registered() -> bool:
            with store.engine.connect() as conn:
                return conn.execute(select(nodes.c.pid).where(nodes.c.node_id == "s0")
                                    ).first() is not None
        wait_until(registered, 30, 0.1)
        store.close()
        second = _scheduler(tmp_path, "second.log")
        assert second.wait(30) == 6
        lines = (tmp_path / "second.log").read_text().strip().splitlines()
        assert any("node name 's0' is in use" in line for line in lines), lines
        assert "Traceback" not in "\n".join(lines)
        assert first.poll() is None  # the live one goes on
    finally:
        stop_all([first])
