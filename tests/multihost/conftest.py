"""The multi-host step (issue 24): engines as they are operated beyond one server — a
RabbitMQ cluster with quorum queues, Redis with Sentinel, a PostgreSQL standby promoted,
hosts in network namespaces cut off from the network.

Every test here is marked ``multihost`` and deselected from the main suite; CI runs them as
their own step (``bash scripts/test.sh -m multihost``). Each starts the servers it needs on
free loopback ports (or in namespaces it creates) and always stops and removes them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.services import unavailable


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.multihost)
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.integration)


def need_tool(what: str, *names: str) -> list[str]:
    """The paths of the given programs, or skip (fail with AX_REQUIRE_SERVICES=1) naming
    the missing one."""
    found = []
    for name in names:
        path = shutil.which(name) or next(
            (str(p) for p in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))), None)
        if path is None:
            unavailable(what, f"{name} not found")
        found.append(path)
    return found


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        unavailable(what, "needs root (network namespaces)")
