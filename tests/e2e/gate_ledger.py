"""The ledger of :mod:`tests.e2e.gate_tasks` as the end-to-end tests read it: each run's
:class:`Entry` (:func:`read_ledger`), and :class:`LedgerSystem`, a :class:`System` whose
daemons are told the ledger file (``E2E_GATES_LEDGER``) and which reads a task type's runs
back; :func:`ledger_cluster` holds one for a test module. The gate tests and the pause
tests use it (:mod:`tests.e2e.pause_tasks` records through the gate processors)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from .gate_tasks import LEDGER_ENV
from .system import System, module_cluster


@dataclass(frozen=True)
class Entry:
    """One processor run, as :func:`tests.e2e.gate_tasks.record` wrote it."""

    task_id: int
    task_type: str
    payload: Any
    job: str | None
    scheduled_at: int | None
    attempt: int
    shard_index: int | None
    shard_total: int | None
    start: float
    end: float
    pid: int
    node: str
    cancelled: bool
    cancel_reason: str | None


def read_ledger(path: Path) -> list[Entry]:
    """Every run recorded so far (a last line still being written is left for later)."""
    try:
        lines = path.read_text().split("\n")[:-1]
    except FileNotFoundError:
        return []
    return [Entry(**json.loads(line)) for line in lines if line.strip()]


@dataclass
class LedgerSystem(System):
    """A :class:`System` whose daemons know the ledger file."""

    ledger: Path = Path("ledger.jsonl")

    def daemon_env(self, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        env = super().daemon_env(extra)
        env[LEDGER_ENV] = str(self.ledger)
        return env

    def runs(self, task_type: str) -> list[Entry]:
        """The runs of ``task_type`` recorded so far."""
        return [e for e in read_ledger(self.ledger) if e.task_type == task_type]


L = TypeVar("L", bound=LedgerSystem)


@contextmanager
def ledger_cluster(system: type[L], database_url: str, redis_url: str,
                   tmp_path_factory: pytest.TempPathFactory, name: str, tables: str,
                   env: Mapping[str, Any]) -> Iterator[L]:
    """A ``system`` for one test module (:func:`tests.e2e.system.module_cluster`), its logs
    and ledger in a new temporary directory ``name``, ``env`` for every daemon."""
    tmp = tmp_path_factory.mktemp(name)
    with module_cluster(lambda broker: system(database_url, broker, tmp, env=env,
                                              ledger=tmp / "ledger.jsonl"),
                        database_url, redis_url, name, tables) as ax:
        yield ax
