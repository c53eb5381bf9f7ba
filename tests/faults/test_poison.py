"""Poison outcomes (issue 22, item 1): a run whose error or return value the store cannot
take as it is must not stall its worker. Real ``ax-scheduler`` and ``ax-worker`` processes
on PostgreSQL + Redis; the processor (:mod:`tests.faults.poison_tasks`) writes a ledger.

Before the fix, the NUL in an error's text made PostgreSQL (psycopg2) refuse the result
batch and the writer retried it for ever, and a 2 MB error kept the writer busy for an hour
(redacting URLs in it); every later outcome waited behind them in memory and its task
stayed RUNNING on a worker that still heartbeats, so nothing recovered it.

Now every task reaches a final state: the two poison errors FAILED with a readable reason,
the two odd values SUCCESS and read back exactly, and the ordinary tasks enqueued after
them SUCCESS; each ran once (ledger), none is left RUNNING.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import System

from .poison_tasks import HUGE, NUL_TEXT, SURROGATE_TEXT

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.integration]

MODULE = "tests.faults.poison_tasks"
POISON = ("nul_error", "huge_error", "nul_value", "surrogate_value")
N_PLAIN = 40


def ledger_runs(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.timeout(90)
def test_poison_errors_and_values_never_stall_the_worker(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> None:
    system = System(pg_url, redis_broker, tmp_path, env={"worker_grace_s": 3})
    ledger = tmp_path / "ledger.jsonl"

    def item(kind: str, i: int) -> dict[str, Any]:
        return {"task_type": "poison.task", "max_retry": 0,
                "payload": {"kind": kind, "i": i, "ledger": str(ledger)}}

    try:
        system.scheduler("s0")
        worker = system.worker("w0", concurrency="high=1,default=4,slow=1",
                               args=["-A", MODULE])
        system.wait_ready(30)
        poison = dict(zip(POISON, system.enqueue_many([item(k, i) for i, k in
                                                       enumerate(POISON)]), strict=True))
        system.wait_for(lambda: len(ledger_runs(ledger)) >= len(POISON), 15,
                        "the poison tasks ran")
        plain = system.enqueue_many([item("plain", i) for i in range(N_PLAIN)])
        system.wait_final(len(POISON) + N_PLAIN, 15)

        views = {t: system.client.get(t) for t in [*poison.values(), *plain]}
        statuses = system.statuses()
        assert worker.alive, system.tails()
    finally:
        system.close()

    assert "RUNNING" not in statuses, statuses
    runs = Counter(r["id"] for r in ledger_runs(ledger))
    assert set(runs) == set(views) and set(runs.values()) == {1}, runs

    nul_error = views[poison["nul_error"]]
    assert (str(nul_error.status), nul_error.last_error) == (
        "FAILED", "ValueError: bad\\x00byte")
    huge = views[poison["huge_error"]]
    assert str(huge.status) == "FAILED" and huge.last_error is not None
    assert huge.last_error.startswith("RuntimeError: xxx") and len(huge.last_error) <= 2000
    assert huge.last_error.endswith(f"[truncated; {len('RuntimeError: ') + HUGE} characters "
                                    "in all]")
    for kind, value in (("nul_value", NUL_TEXT), ("surrogate_value", SURROGATE_TEXT)):
        view = views[poison[kind]]
        assert (str(view.status), view.result) == ("SUCCESS", value), (kind, view)
    bad = {t: (v.status, v.last_error) for t, v in views.items()
           if t in plain and (str(v.status) != "SUCCESS" or v.result != v.payload["i"])}
    assert not bad, bad
