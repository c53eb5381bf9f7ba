"""Gates in real processes: two ``ax-scheduler`` and two ``ax-worker`` (``-n gate-w0``,
``-n gate-w1``) on PostgreSQL + Redis, one cluster for the whole module. The processor
(:mod:`tests.e2e.gate_tasks`) appends a ledger line per run — start, end, worker, shard,
whether ``ctx.cancelled`` was set — and the verdicts are computed from that ledger and the
``ax_task`` rows:

* **order keys**: 200 tasks on 20 keys, due at one instant, 20 ms each: per key, runs in
  enqueue order and never overlapping; different keys run at the same time;
* **limit**: ``set_limit(type, 5)``, 200 tasks of 100 ms due at once: never more than 5
  running at once across both workers, all done within 2.5 × the ideal 4 s;
* **serial job** (every 1 s, runs of 2.5 s): runs never overlap, start in occurrence
  order and skip none; the occurrences due meanwhile wait (READY, parked), none cancelled;
* **discard job** (every 1 s, runs of 2.5 s): occurrences due while one runs are CANCELLED
  as "discarded", never run; runs never overlap; no due occurrence is left waiting;
* **cover job** (every 1 s, runs wait 5 s on ``ctx.cancelled``): each new occurrence
  supersedes the running one — CANCELLED "superseded by task …", its ``ctx.cancelled`` set
  at the worker's next heartbeat, its result never recorded SUCCESS;
* **shards**: ``enqueue(..., shards=8)`` runs shard 0..7 once each, ``shard_total`` 8;
* **a shard per worker**: ``enqueue(..., shards="workers")`` runs one shard on each of the
  two workers (index 0 and 1 of 2), each on the worker its row names (``target_node``);
* **a shard whose worker died** (SIGKILL while its heartbeat is still fresh, the task
  enqueued at once, so the claim still counts it live): once the worker is declared dead
  its shard goes back (``last_error`` "… died before this shard started …") and runs on
  the other worker, once; restarted, the killed worker refuses the stale message left in
  its own queue. This one kills a worker of the shared cluster, so it runs last and
  restarts it.

Heartbeats are 0.5 s (× 3 misses), as in :mod:`tests.e2e.test_recurring`. Every wait polls
against a deadline, but for the wall-clock time the job scenarios let pass; a failure shows
each daemon's log tail.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from ax_kombu.config import worker_queue
from ax_kombu.core import cron

from .gate_ledger import Entry, LedgerSystem, ledger_cluster
from .gate_tasks import NODE_ENV

MODULE = "tests.e2e.gate_tasks"
HEARTBEAT = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 3}
WORKERS = ("gate-w0", "gate-w1")
SCHEDULERS = ("gate-s0", "gate-s1")
#: a daemon setting this module reads itself (the worker's name for the ledger), not ``AX_*``
_NODE_KEY = "e2e_gates_node"
ACTIVE = ("DISPATCHING", "RUNNING")


# -- the ledger ----------------------------------------------------------------------------------


def max_concurrency(entries: Iterable[Entry]) -> int:
    """The most runs in progress at one instant (an end at the instant of a start is
    counted before it)."""
    events = sorted(itertools.chain.from_iterable(((e.start, 1), (e.end, -1)) for e in entries))
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


def overlaps(entries: list[Entry]) -> list[tuple[int, int, float]]:
    """``(earlier, later, seconds)`` for each run starting before the previous one (by
    start) ended."""
    ordered = sorted(entries, key=lambda e: e.start)
    return [(a.task_id, b.task_id, round(a.end - b.start, 4))
            for a, b in itertools.pairwise(ordered) if b.start < a.end]


def brief(entries: Iterable[Entry], origin: float) -> str:
    return ", ".join(f"{e.task_id}@{e.scheduled_at}[{e.start - origin:.3f}..{e.end - origin:.3f}"
                     f"{' cancelled' if e.cancelled else ''} {e.node}]" for e in entries)


def nodes(entries: Iterable[Entry]) -> dict[str, int]:
    return dict(sorted(Counter(e.node for e in entries).items()))


# -- the cluster ---------------------------------------------------------------------------------


@dataclass
class GateSystem(LedgerSystem):
    """A :class:`LedgerSystem` whose workers know their name (``E2E_GATES_NODE``)."""

    def daemon_env(self, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        settings = dict(extra or {})
        node = settings.pop(_NODE_KEY, None)
        env = super().daemon_env(settings)
        if node is not None:
            env[NODE_ENV] = str(node)
        return env

    def start(self) -> None:
        """Two schedulers and two workers, registered."""
        for name in SCHEDULERS:
            self.scheduler(name)
        for name in WORKERS:
            self.worker(name, args=("-A", MODULE), env={_NODE_KEY: name})
        self.wait_ready()

    def check_alive(self) -> None:
        dead = [d.name for d in self.daemons if not d.alive]
        assert not dead, f"daemons exited: {dead}\n{self.tails()}"

    def wait_runs(self, task_type: str, check: Any, timeout: float, what: str) -> list[Entry]:
        """Poll the ledger until ``check(runs of task_type)`` is true; returns those runs."""
        found: list[list[Entry]] = []

        def done() -> bool:
            found[:] = [self.runs(task_type)]
            return bool(check(found[0]))

        self.wait_for(done, timeout, what,
                      detail=lambda: f"{len(found[0]) if found else 0} runs of {task_type}")
        return found[0]

    def rows(self, where: str, **params: Any) -> dict[int, Any]:
        return {r.task_id: r for r in self.query(f"SELECT * FROM ax_task WHERE {where}",
                                                 **params)}

    def job_rows(self, name: str) -> dict[int, Any]:
        return self.rows("job = :n", n=name)

    def job_row(self, name: str) -> Any:
        return self.query("SELECT * FROM ax_job WHERE name = :n", n=name)[0]

    @staticmethod
    def occurrences(row: Any, until: int) -> list[int]:
        """The occurrences of the job ``row`` from its creation up to ``until`` (epoch ms)."""
        schedule = cron.make_schedule(row.cron, row.every_ms, row.tz, row.anchor_ms)
        out: list[int] = []
        t = schedule.next_after(row.created_at)
        while t is not None and t <= until:
            out.append(t)
            t = schedule.next_after(t)
        return out

    def end_job(self, name: str, timeout: float) -> None:
        """Unschedule ``name`` and wait until none of its occurrences is in progress."""
        self.client.unschedule(name)
        self.wait_for(lambda: not self.rows("job = :n AND status IN ('DISPATCHING', 'RUNNING')",
                                            n=name), timeout, f"the runs of {name} ended")


@pytest.fixture(scope="module")
def cluster(pg_database: str, redis_url: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateSystem]:
    """One cluster for the module, on this run's database (emptied) and its own Redis
    queues and key prefix."""
    with ledger_cluster(GateSystem, pg_database, redis_url, tmp_path_factory, "gates",
                        "ax_task, ax_node, ax_job, ax_limit, ax_due", HEARTBEAT) as ax:
        ax.start()
        yield ax


def due_in(cluster: GateSystem, ms: int) -> tuple[int, datetime]:
    """A trigger instant ``ms`` from now on the store's clock: epoch ms and datetime."""
    at = cluster.client.store.now_ms() + ms
    return at, datetime.fromtimestamp(at / 1000, UTC)


# -- order keys ----------------------------------------------------------------------------------

KEYS = 20
PER_KEY = 10


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_order_keys_run_in_order_per_key_and_keys_run_together(cluster: GateSystem) -> None:
    cluster.check_alive()
    due_ms, run_at = due_in(cluster, 1000)
    # enqueued round-robin over the keys: ids interleave, a key's ids rise with its seq
    items = [{"task_type": "e2e.ordered", "run_at": run_at, "order_key": f"key-{i % KEYS}",
              "payload": {"key": f"key-{i % KEYS}", "seq": i // KEYS, "sleep": 0.02}}
             for i in range(KEYS * PER_KEY)]
    ids = cluster.enqueue_many(items)
    total = len(ids)
    runs = cluster.wait_runs("e2e.ordered", lambda r: len(r) >= total, 60,
                             f"{total} ordered tasks ran")
    cluster.wait_for(lambda: len(cluster.rows("task_type = 'e2e.ordered' AND status = "
                                              "'SUCCESS'")) == total, 15,
                     "every ordered task recorded SUCCESS", detail=cluster.statuses)

    assert sorted(e.task_id for e in runs) == sorted(ids), "a task ran twice or never"
    origin = due_ms / 1000
    by_key: dict[str, list[Entry]] = defaultdict(list)
    for e in runs:
        by_key[e.payload["key"]].append(e)
    gaps: list[float] = []
    for key, entries in sorted(by_key.items()):
        entries.sort(key=lambda e: e.start)
        expected = [i for i, item in zip(ids, items, strict=True)
                    if item["order_key"] == key]  # trigger ties: by id = enqueue order
        assert [e.task_id for e in entries] == expected, (
            f"{key}: ran in order {[e.task_id for e in entries]}, enqueued {expected}; "
            f"{brief(entries, origin)}")
        assert [e.payload["seq"] for e in entries] == list(range(PER_KEY)), key
        assert not overlaps(entries), (
            f"{key}: runs overlap {overlaps(entries)}; {brief(entries, origin)}")
        gaps += [b.start - a.end for a, b in itertools.pairwise(entries)]
    most = max_concurrency(runs)
    span = max(e.end for e in runs) - min(e.start for e in runs)
    print(f"\norder keys: {total} tasks on {KEYS} keys, 20 ms each; max concurrency {most}, "
          f"span {span:.2f} s (first start {min(e.start for e in runs) - origin:+.3f} s "
          f"from due), hand-off within a key mean {1000 * sum(gaps) / len(gaps):.1f} ms "
          f"max {1000 * max(gaps):.1f} ms; by worker {nodes(runs)}")
    assert most > 1, f"keys never ran together: max concurrency {most}"


# -- limits --------------------------------------------------------------------------------------

LIMIT = 5
LIMITED = 200
LIMITED_S = 0.1


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_limit_caps_running_tasks_across_the_cluster(cluster: GateSystem) -> None:
    cluster.check_alive()
    cluster.client.set_limit("e2e.limited", LIMIT)
    due_ms, run_at = due_in(cluster, 1000)
    ids = cluster.enqueue_many([{"task_type": "e2e.limited", "run_at": run_at,
                                 "payload": {"i": i, "sleep": LIMITED_S}}
                                for i in range(LIMITED)])
    ideal = LIMITED * LIMITED_S / LIMIT
    runs = cluster.wait_runs("e2e.limited", lambda r: len(r) >= LIMITED, 1 + ideal * 2.5 + 20,
                             f"{LIMITED} limited tasks ran")
    cluster.wait_for(lambda: len(cluster.rows("task_type = 'e2e.limited' AND status = "
                                              "'SUCCESS'")) == LIMITED, 15,
                     "every limited task recorded SUCCESS", detail=cluster.statuses)

    assert sorted(e.task_id for e in runs) == sorted(ids), "a task ran twice or never"
    most = max_concurrency(runs)
    first, last = min(e.start for e in runs), max(e.end for e in runs)
    from_due = last - due_ms / 1000
    print(f"\nlimit {LIMIT}: {LIMITED} tasks of {LIMITED_S * 1000:.0f} ms; max concurrency "
          f"{most}; span first start → last end {last - first:.2f} s, due → last end "
          f"{from_due:.2f} s (ideal {ideal:.1f} s); by worker {nodes(runs)}")
    cluster.client.set_limit("e2e.limited", None)
    assert most <= LIMIT, f"{most} ran at once, over the limit {LIMIT}"
    assert from_due <= ideal * 2.5, (
        f"{LIMITED} tasks took {from_due:.2f} s from due, over 2.5 × the ideal {ideal:.1f} s")


# -- job strategies ------------------------------------------------------------------------------

#: a strategy job's run: twice its period, so occurrences fall due while one runs
SLOW_S = 2.0
#: how long the serial job is watched (ms of occurrences): its fourth run starts about then, so
#: the fourth occurrence may be READY or already dispatched when the rows are read
SERIAL_WATCH_MS = 7_000


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_serial_job_runs_one_occurrence_at_a_time_and_drops_none(cluster: GateSystem) -> None:
    cluster.check_alive()
    job = cluster.client.schedule("e2e.serial", "e2e.serial", {"sleep": SLOW_S}, every=1,
                                  strategy="serial")
    plan = cluster.job_row("e2e.serial")  # unschedule() deletes it
    watch_until = job.created_at + SERIAL_WATCH_MS
    cluster.wait_runs("e2e.serial", lambda r: len(r) >= 3, 25, "three serial runs")
    while cluster.client.store.now_ms() < watch_until:  # occurrences are wall time
        time.sleep(0.05)
    seen_at = cluster.client.store.now_ms()
    rows = cluster.job_rows("e2e.serial")  # before unschedule() removes the waiting ones
    runs = sorted(cluster.runs("e2e.serial"), key=lambda e: e.start)
    cluster.end_job("e2e.serial", SLOW_S + 10)

    origin = job.created_at / 1000
    context = f"runs: {brief(runs, origin)}\n{cluster.tails()}"
    assert len(runs) >= 3, context
    assert not overlaps(runs), f"serial runs overlap: {overlaps(runs)}; {context}"
    started = [e.scheduled_at for e in runs]
    assert started == cluster.occurrences(plan, seen_at)[:len(runs)], (
        f"serial runs did not start in occurrence order, or skipped one: {started}; {context}")
    cancelled = {t: (r.scheduled_at, r.last_error) for t, r in rows.items()
                 if r.status == "CANCELLED"}
    assert not cancelled, f"serial occurrences were cancelled: {cancelled}; {context}"
    ran = {e.task_id for e in runs}
    # due for a second and not started: they must be waiting, not dropped
    waiting = {t: r for t, r in rows.items() if t not in ran and r.started_at is None
               and r.scheduled_at <= seen_at - 1000}
    # the earliest one may already be on its way: the run before it ended just before seen_at
    head = min(waiting, key=lambda t: waiting[t].scheduled_at, default=None)
    not_ready = {t: (r.scheduled_at, r.status, r.owner_node) for t, r in waiting.items()
                 if r.status != "READY"
                 and not (t == head and r.status in ("DISPATCHING", "RUNNING"))}
    parked = [t for t, r in waiting.items() if r.parked]
    print(f"\nserial job, every 1 s, runs of {SLOW_S} s, watched "
          f"{(seen_at - job.created_at) / 1000:.1f} s: {len(runs)} runs "
          f"({', '.join(f'{e.end - e.start:.2f}s' for e in runs)}), gaps between runs "
          f"{[round(b.start - a.end, 3) for a, b in itertools.pairwise(runs)]} s; "
          f"{len(waiting)} due occurrences waiting ({len(parked)} parked), 0 cancelled; "
          f"by worker {nodes(runs)}")
    assert waiting, f"no due occurrence was waiting after {len(runs)} runs; {context}"
    assert not not_ready, f"due occurrences not READY: {not_ready}; {context}"
    assert parked, f"no waiting occurrence was parked: {waiting}; {context}"


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_discard_job_cancels_occurrences_due_while_one_runs(cluster: GateSystem) -> None:
    cluster.check_alive()
    job = cluster.client.schedule("e2e.discard", "e2e.discard", {"sleep": SLOW_S}, every=1,
                                  strategy="discard")
    plan = cluster.job_row("e2e.discard")  # unschedule() deletes it

    def discarded() -> int:
        return len(cluster.rows("job = 'e2e.discard' AND status = 'CANCELLED'"))

    cluster.wait_runs("e2e.discard", lambda r: len(r) >= 2 and discarded() >= 3, 25,
                      "two discard runs and three discarded occurrences")
    seen_at = cluster.client.store.now_ms()
    cluster.end_job("e2e.discard", SLOW_S + 10)
    runs = sorted(cluster.runs("e2e.discard"), key=lambda e: e.start)
    rows = cluster.job_rows("e2e.discard")

    origin = job.created_at / 1000
    by_id = {e.task_id: e for e in runs}
    context = f"runs: {brief(runs, origin)}\n{cluster.tails()}"
    assert not overlaps(runs), f"discard runs overlap: {overlaps(runs)}; {context}"
    dropped = {t: r for t, r in rows.items() if r.status == "CANCELLED"}
    other = {t: r.last_error for t, r in dropped.items() if "discarded" not in (r.last_error or "")}
    assert not other, f"occurrences cancelled for another reason: {other}; {context}"
    ran_dropped = [t for t, r in dropped.items() if t in by_id or r.started_at is not None]
    assert not ran_dropped, f"discarded occurrences ran: {ran_dropped}; {context}"
    for task_id, row in sorted(dropped.items(), key=lambda i: i[1].scheduled_at):
        match = re.search(r"task (\d+)", row.last_error)
        blocker = by_id.get(int(match.group(1))) if match else None
        assert blocker is not None and blocker.scheduled_at < row.scheduled_at, (
            f"{task_id} (due {row.scheduled_at}) discarded for a task that is no earlier "
            f"run: {row.last_error!r}; {context}")
        due = row.scheduled_at / 1000
        assert blocker.start - 0.5 <= due <= blocker.end + 0.5, (
            f"{task_id} (due {due - origin:.3f}) discarded while {blocker.task_id} was not "
            f"running [{blocker.start - origin:.3f}..{blocker.end - origin:.3f}]; {context}")
    # every occurrence due a second before the end ran or was discarded: none waited
    due = cluster.occurrences(plan, seen_at - 1000)
    fate = {r.scheduled_at: ("ran" if t in by_id else r.status) for t, r in rows.items()}
    lost = [(t, fate.get(t, "gone")) for t in due if fate.get(t) not in ("ran", "CANCELLED")]
    print(f"\ndiscard job, every 1 s, runs of {SLOW_S} s, watched "
          f"{(seen_at - job.created_at) / 1000:.1f} s: {len(runs)} runs, {len(dropped)} "
          f"discarded, {len(due)} occurrences due; by worker {nodes(runs)}")
    assert not lost, f"due occurrences neither run nor discarded: {lost}; {context}"
    assert len(runs) >= 2 and len(dropped) >= 3, context


#: how long a cover run waits on ctx.cancelled: a superseded one returns after about 1 s,
#: the last one (after unschedule) waits it out
COVER_WAIT_S = 3.0


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_cover_job_supersedes_the_running_occurrence(cluster: GateSystem) -> None:
    cluster.check_alive()
    job = cluster.client.schedule("e2e.cover", "e2e.cover", {"wait": COVER_WAIT_S}, every=1,
                                  strategy="cover")
    cluster.wait_runs("e2e.cover", lambda r: sum(e.cancelled for e in r) >= 3, 25,
                      "three cover runs signalled")
    cluster.end_job("e2e.cover", COVER_WAIT_S + 10)
    runs = sorted(cluster.runs("e2e.cover"), key=lambda e: e.start)
    rows = cluster.job_rows("e2e.cover")

    origin = job.created_at / 1000
    by_id = {e.task_id: e for e in runs}
    context = (f"runs: {brief(runs, origin)}\nrows: "
               f"{[(t, r.scheduled_at, r.status, r.last_error) for t, r in sorted(rows.items())]}"
               f"\n{cluster.tails()}")
    superseded = {t: r for t, r in rows.items() if r.status == "CANCELLED"
                  and "superseded by task" in (r.last_error or "")}
    other = {t: (r.status, r.last_error) for t, r in rows.items()
             if r.status not in ("SUCCESS", "CANCELLED") or
             (r.status == "CANCELLED" and t not in superseded)}
    assert not other, f"cover occurrences neither SUCCESS nor superseded: {other}; {context}"
    # a run signalled must be a superseded row (never SUCCESS), and the reverse
    signalled_success = [t for t, e in by_id.items() if e.cancelled and t not in superseded]
    assert not signalled_success, (
        f"runs whose ctx.cancelled was set but whose row is not superseded (status "
        f"{[(t, rows[t].status) for t in signalled_success]}); {context}")
    started = [t for t, r in superseded.items() if r.started_at is not None or t in by_id]
    unsignalled = [t for t in started if t not in by_id or not by_id[t].cancelled]
    assert not unsignalled, (
        f"superseded running occurrences whose ctx.cancelled was not set: {unsignalled}; "
        f"{context}")
    latency = []
    for t in started:
        match = re.search(r"superseded by task (\d+)", superseded[t].last_error)
        later = rows.get(int(match.group(1))) if match else None
        assert later is not None and later.scheduled_at > superseded[t].scheduled_at, (
            f"{t} superseded by no later occurrence: {superseded[t].last_error!r}; {context}")
        assert by_id[t].end - by_id[t].start < COVER_WAIT_S, f"{t} was not cut short; {context}"
        latency.append(by_id[t].end - superseded[t].finished_at / 1000)
    success = [t for t, r in rows.items() if r.status == "SUCCESS"]
    print(f"\ncover job, every 1 s, runs wait {COVER_WAIT_S:.0f} s on ctx.cancelled: "
          f"{len(runs)} runs, {len(started)} superseded while running (signal → return "
          f"after the supersede {min(latency):.2f}..{max(latency):.2f} s), "
          f"{len(superseded) - len(started)} superseded before starting, {len(success)} "
          f"SUCCESS (the last, after unschedule); by worker {nodes(runs)}")
    assert len(started) >= 3, context


# -- shards --------------------------------------------------------------------------------------

SHARDS = 8


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(60)
def test_shards_run_each_index_once(cluster: GateSystem) -> None:
    cluster.check_alive()
    task_id = cluster.client.enqueue("e2e.shard", {"batch": uuid.uuid4().hex}, shards=SHARDS)
    ids = set(task_id.shards)
    assert len(ids) == SHARDS and int(task_id) == task_id.shards[0]
    runs = cluster.wait_runs("e2e.shard", lambda r: len({e.task_id for e in r} & ids) >= SHARDS,
                             20, f"{SHARDS} shards ran")
    cluster.wait_for(lambda: len(cluster.rows("task_type = 'e2e.shard' AND status = "
                                              "'SUCCESS'")) == SHARDS, 15,
                     "every shard recorded SUCCESS", detail=cluster.statuses)
    runs = [e for e in runs if e.task_id in ids]
    indexes = sorted(e.shard_index for e in runs if e.shard_index is not None)
    print(f"\nshards={SHARDS}: {len(runs)} runs, indexes {indexes}, totals "
          f"{sorted({e.shard_total or 0 for e in runs})}; by worker {nodes(runs)}")
    assert indexes == list(range(SHARDS)) and len(runs) == SHARDS, \
        f"shard indexes {[(e.task_id, e.shard_index) for e in runs]}"
    assert {e.shard_total for e in runs} == {SHARDS}
    assert {e.task_id: e.shard_index for e in runs} == {
        t: i for i, t in enumerate(task_id.shards)}, "shard index not in enqueue's shard order"


# -- a shard per worker --------------------------------------------------------------------------


def heartbeat_age_ms(cluster: GateSystem, name: str) -> int:
    """How long ago (store clock, ms) ``name`` last heartbeated."""
    (row,) = cluster.query("SELECT heartbeat_at FROM ax_node WHERE node_id = :n", n=name)
    return cluster.client.store.now_ms() - int(row.heartbeat_at)


def shard_rows(cluster: GateSystem, task_type: str) -> dict[int, Any]:
    return cluster.rows("task_type = :t", t=task_type)


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_workers_broadcast_runs_one_shard_on_each_worker(cluster: GateSystem) -> None:
    cluster.check_alive()
    cluster.wait_for(lambda: all(heartbeat_age_ms(cluster, w) < 1000 for w in WORKERS), 10,
                     "both workers heartbeating")
    first = int(cluster.client.enqueue("e2e.broadcast", {"sleep": 0.05}, shards="workers"))
    runs = cluster.wait_runs("e2e.broadcast", lambda r: len(r) >= len(WORKERS), 20,
                             f"{len(WORKERS)} broadcast shards ran")
    cluster.wait_for(lambda: len(cluster.rows("task_type = 'e2e.broadcast' AND status = "
                                              "'SUCCESS'")) == len(WORKERS), 15,
                     "every broadcast shard recorded SUCCESS", detail=cluster.statuses)
    rows = shard_rows(cluster, "e2e.broadcast")
    runs = cluster.runs("e2e.broadcast")  # again: nothing more ran after both SUCCESS
    where = {e.task_id: e.node for e in runs}
    shown = [(t, r.status, r.shard_index, r.shard_total, r.target_node)
             for t, r in sorted(rows.items())]
    context = (f"runs: {[(e.task_id, e.node, e.shard_index, e.shard_total) for e in runs]}; "
               f"rows: {shown}\n{cluster.tails()}")
    placed = [(t, f"{r.shard_index}/{r.shard_total}", r.target_node, where.get(t))
              for t, r in sorted(rows.items())]
    print(f"\nshards=\"workers\": {len(rows)} shards, {len(runs)} runs; "
          f"(task, index/total, target → ran on) "
          f"{placed}")
    assert len(runs) == len(WORKERS) and len(where) == len(WORKERS), (
        f"not one run per shard; {context}")
    assert set(rows) == set(where) and first in rows, f"runs and shard rows differ; {context}"
    assert sorted(where.values()) == sorted(WORKERS), f"not one shard per worker; {context}"
    assert sorted(r.shard_index for r in rows.values()) == list(range(len(WORKERS))), context
    assert rows[first].shard_index == 0, f"the enqueued task is not shard 0; {context}"
    assert {r.shard_total for r in rows.values()} == {len(WORKERS)}, context
    assert {(e.shard_index, e.shard_total) for e in runs} == {
        (r.shard_index, r.shard_total) for r in rows.values()}, context
    wrong = {t: (r.target_node, where[t]) for t, r in rows.items() if r.target_node != where[t]}
    assert not wrong, f"shards that ran on another worker than their target: {wrong}; {context}"


def own_queue_depth(cluster: GateSystem, node: str) -> int:
    """Messages waiting in ``node``'s own queue (every priority list of it) in Redis."""
    import redis

    client = redis.Redis.from_url(cluster.broker["broker_url"])
    try:
        keys = client.keys(cluster.broker["broker_key_prefix"] + worker_queue(node) + "*")
        return sum(client.llen(k) for k in keys if client.type(k) == b"list")
    finally:
        client.close()


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_shard_whose_worker_died_before_starting_runs_on_another(cluster: GateSystem
                                                                    ) -> None:
    # last in the module: it kills gate-w1 (and restarts it at the end)
    cluster.check_alive()
    victim_name, survivor = WORKERS[1], WORKERS[0]
    (victim,) = [d for d in cluster.daemons if d.name == victim_name]
    # a heartbeat just written, so the claim (within ms of the enqueue) still counts the
    # victim live: it is declared dead only after 3 × 0.5 s of silence
    cluster.wait_for(lambda: heartbeat_age_ms(cluster, victim_name) < 150
                     and heartbeat_age_ms(cluster, survivor) < 1000, 10,
                     f"a fresh heartbeat of {victim_name}")
    cluster.kill(victim)
    age = heartbeat_age_ms(cluster, victim_name)
    first = int(cluster.client.enqueue("e2e.broadcast_orphan", {"sleep": 0.05},
                                       shards="workers"))
    killed_at = time.time()

    def expanded() -> dict[int, Any]:
        rows = shard_rows(cluster, "e2e.broadcast_orphan")
        return rows if rows and rows[first].shard_total is not None else {}

    rows = cluster.wait_for(expanded, 10, "the broadcast expanded into shards",
                            detail=lambda: shard_rows(cluster, "e2e.broadcast_orphan"))
    seen = {t: (r.status, r.shard_index, r.shard_total, r.target_node) for t, r in rows.items()}
    assert rows[first].shard_total == len(WORKERS), (
        f"{victim_name} (SIGKILLed, heartbeat {age} ms old at the enqueue) was already "
        f"counted dead when the task was claimed: {seen}\n{cluster.tails()}")
    (orphan,) = [t for t, r in rows.items() if r.target_node == victim_name]

    def both_ran() -> bool:
        runs = cluster.runs("e2e.broadcast_orphan")
        done = cluster.rows("task_type = 'e2e.broadcast_orphan' AND status = 'SUCCESS'")
        return len({e.task_id for e in runs}) >= len(WORKERS) and len(done) >= len(WORKERS)

    cluster.wait_for(both_ran, 20, "both shards ran and recorded SUCCESS",
                     detail=lambda: (cluster.runs("e2e.broadcast_orphan"),
                                     shard_rows(cluster, "e2e.broadcast_orphan")))
    rows = shard_rows(cluster, "e2e.broadcast_orphan")
    runs = cluster.runs("e2e.broadcast_orphan")
    depth = own_queue_depth(cluster, victim_name)  # the message no one took
    orphan_run = [e for e in runs if e.task_id == orphan]
    ran = [(e.task_id, e.node, e.shard_index, e.attempt, round(e.start - killed_at, 3))
           for e in runs]
    shown = [(t, r.status, r.shard_index, r.shard_total, r.target_node, r.attempt, r.last_error)
             for t, r in sorted(rows.items())]
    context = f"runs: {ran}; rows: {shown}\n{cluster.tails()}"
    print(f"\nshards=\"workers\", {victim_name} SIGKILLed (heartbeat {age} ms old) just "
          f"before the enqueue: at the claim {seen}, {depth} message(s) left in its own "
          f"queue; shard {orphan} re-sent and ran on "
          f"{[e.node for e in orphan_run]} {[round(e.start - killed_at, 2) for e in orphan_run]} s "
          f"after the kill, attempt {rows[orphan].attempt}: {rows[orphan].last_error!r}")
    assert len(runs) == len(WORKERS) and {e.task_id for e in runs} == set(rows), (
        f"not each shard exactly once; {context}")
    assert {e.node for e in runs} == {survivor}, f"a shard did not run on {survivor}; {context}"
    assert sorted(e.shard_index for e in runs) == list(range(len(WORKERS))), context
    assert "died before this shard started" in (rows[orphan].last_error or ""), (
        f"the re-sent shard {orphan} does not say why; {context}")
    assert rows[orphan].target_node is None, context
    assert depth == 1, f"{depth} messages in {victim_name}'s own queue, not its shard's; {context}"

    # the cluster whole again: the victim restarted under its name refuses the stale
    # message left in its own queue; nothing runs a third time
    log = cluster.tmp / f"{victim_name}.log"
    before = log.stat().st_size
    cluster.daemons.remove(victim)
    cluster.worker(victim_name, args=("-A", MODULE), env={_NODE_KEY: victim_name})
    cluster.wait_for(lambda: heartbeat_age_ms(cluster, victim_name) < 1000
                     and victim_name in cluster.live_nodes(), 30, f"{victim_name} restarted")
    cluster.wait_for(lambda: own_queue_depth(cluster, victim_name) == 0, 15,
                     f"{victim_name}'s own queue drained")
    cluster.wait_for(lambda: "stale message" in log.read_bytes()[before:].decode(errors="replace"),
                     15, f"{victim_name} refused the stale shard message")
    cluster.check_alive()
    again = cluster.runs("e2e.broadcast_orphan")
    assert len(again) == len(WORKERS), f"a shard ran again after the restart; {context}"
