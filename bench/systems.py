"""The systems :mod:`bench.run` compares, each started fresh for one measured run.

Each is a context manager ``(config, ledger_key, tag) → Running``: on entry its processes
are up on loopback with their own scratch state (a PostgreSQL database, a Redis key prefix
or the run's RabbitMQ vhost); :attr:`Running.submit` hands it ``(i, due_ms)`` tasks ahead
of their due time; on exit everything it started is stopped (SIGTERM, then SIGKILL after
60 s) and its state dropped. Every system runs the same body (:mod:`bench.ledger`) on 16
threads by default:

* ``ax`` — one ``ax-scheduler`` and one ``ax-worker -Q high,default,slow`` with the default
  pools unless ``--ax-concurrency`` (the tasks go to ``default``: 16 threads), tasks
  created with ``Client.enqueue_many(run_at=…)``.
* ``celery`` — one stock ``celery worker -P threads -c THREADS`` (no gossip, mingle or
  heartbeat), tasks sent with ``apply_async(eta=…)`` from 4 producer threads (Celery has
  no bulk send: each call is a binding lookup and an LPUSH on Redis, and the worker
  takes the ETA messages in meanwhile; ~80–600 calls/s on this machine under load).
* ``celery-ax`` — the ``celery`` system's worker and producer, unchanged, but the producer's
  app has ``ax.celery.install(app)``: its ETA calls are stored in ax, and one
  ``ax-scheduler`` sends each to the Celery worker when due (issue 16).
* ``polling`` — :mod:`bench.poller` (200 ms ticks, ``FOR UPDATE SKIP LOCKED LIMIT 1000``,
  a pool of THREADS) over a plain table, rows inserted in one transaction.
* ``tight-poller`` — :mod:`bench.poller` ``--tight`` over the same table: THREADS threads,
  each claiming ``LIMIT 50`` due rows in a loop that re-polls at once while rows come back
  (50 ms sleep after an empty claim), marking them done in one statement.
* ``pgqueuer`` — :mod:`bench.pgqueuer_worker`: PgQueuer's ``pgq run`` equivalent on a
  dedicated asyncpg connection, ``batch_size`` 8, ``max_concurrent_tasks`` THREADS, the
  body on THREADS threads; tasks enqueued in batches with ``execute_after`` = due.
* ``procrastinate`` — :mod:`bench.procrastinate_worker` (its app and producer:
  :mod:`bench.procrastinate_app`): one worker with ``concurrency`` THREADS, a pool of
  THREADS + 1, 50 ms ``fetch_job_polling_interval``; tasks batch-deferred with
  ``schedule_at`` = due.

The three peers' libraries are in the ``bench`` extra; each is imported only when its
system runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import from_env

from . import ledger, poller
from .common import drop_redis_keys, scratch_database
from .e2e import ROOT, _env, spawned, wait_ready

Task = tuple[int, int]  # (i, due_ms)
#: threads sending Celery's ETA messages (one ``apply_async`` per task, a round trip each)
CELERY_PRODUCERS = 4


@dataclass(frozen=True)
class Config:
    """What every system of one invocation shares."""

    #: ``redis`` or ``rabbitmq``: the broker ax and Celery use (the PostgreSQL peers none)
    broker: str
    #: the broker URL (a scratch vhost on RabbitMQ)
    broker_url: str
    #: the Redis holding the ledgers (and the broker on ``redis``)
    redis_url: str
    #: this invocation's Redis key prefix and database name stem
    prefix: str
    #: threads running the body in Celery, the pollers, PgQueuer and Procrastinate (ax: its
    #: default pools)
    threads: int
    logs: Path
    #: ax-worker ``-c`` (e.g. ``default=64``); empty: ax's default pools
    ax_concurrency: str = ""
    #: ``SETTING=VALUE`` items for the ax daemons (``--ax-set claim_lead_ms=20`` →
    #: ``AX_CLAIM_LEAD_MS=20``), for A/B runs of one setting
    ax_set: tuple[str, ...] = ()
    #: ax-worker ``--processes``; empty: its default (auto)
    ax_processes: str = ""


@dataclass
class Running:
    """A system that is up: hand it tasks, watch its processes."""

    submit: Callable[[list[Task]], None]
    #: role → process; ``worker`` is the one running the body
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs.values())


System = Callable[[Config, str, str], AbstractContextManager[Running]]


def _due(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _ledger_env(config: Config, key: str) -> dict[str, str]:
    return {ledger.URL_VAR: config.redis_url, ledger.KEY_VAR: key}


def _plain_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AX_", "AXBENCH_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return {**env, **extra}


@contextmanager
def _process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` running in the repository root, logging to ``log``; warm-stopped on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def ax_system(config: Config, key: str, tag: str) -> Iterator[Running]:
    """One ``ax-scheduler`` + one ``ax-worker`` on a scratch database."""
    with scratch_database(f"{config.prefix}{tag}") as url:
        settings = from_env({}, database_url=url, broker_url=config.broker_url,
                            broker_key_prefix=f"{config.prefix}{tag}:")
        env = {**_env(settings, list(config.ax_set)), **_ledger_env(config, key)}
        worker = ["-Q", "high,default,slow", "-A", "bench.ax_tasks", "-l", "WARNING"]
        if config.ax_concurrency:
            worker += ["-c", config.ax_concurrency]
        if config.ax_processes:
            worker += ["--processes", config.ax_processes]
        specs = [("scheduler", f"{tag}-scheduler", ["-l", "WARNING"]),
                 ("worker", f"{tag}-worker", worker)]
        client = Client(settings)
        try:
            with spawned(specs, env, config.logs) as procs:
                wait_ready(client, procs)

                def submit(tasks: list[Task]) -> None:
                    for start in range(0, len(tasks), 20_000):
                        client.enqueue_many([
                            {"task_type": "bench.ledger", "run_at": _due(due),
                             "payload": {"i": i, "due": due}}
                            for i, due in tasks[start:start + 20_000]])

                yield Running(submit, {"scheduler": procs[0], "worker": procs[1]})
        finally:
            client.close()
            if config.broker == "redis":
                drop_redis_keys(config.broker_url, f"{config.prefix}{tag}:")


def _celery_queue(config: Config, tag: str) -> tuple[str, str]:
    """The run's Celery queue, and its Redis key prefix (none on RabbitMQ: a scratch vhost)."""
    queue = f"{config.prefix}{tag}"
    return queue, f"{queue}:" if config.broker == "redis" else ""


@contextmanager
def _celery_worker(config: Config, key: str, tag: str) -> Iterator[subprocess.Popen[bytes]]:
    """One stock ``celery worker -P threads -c THREADS`` on the run's queue (no gossip,
    mingle or heartbeat), logging to ``TAG-worker.log``; warm-stopped on exit."""
    queue, prefix = _celery_queue(config, tag)
    env = _plain_env({"AXBENCH_CELERY_BROKER": config.broker_url,
                      "AXBENCH_CELERY_PREFIX": prefix, "AXBENCH_CELERY_QUEUE": queue,
                      **_ledger_env(config, key)})
    cmd = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", "-P", "threads",
           "-c", str(config.threads), "-Q", queue, "-n", f"{tag}@localhost", "-l", "WARNING",
           "--without-gossip", "--without-mingle", "--without-heartbeat"]
    with _process(cmd, env, config.logs / f"{tag}-worker.log") as proc:
        yield proc


@contextmanager
def celery_system(config: Config, key: str, tag: str) -> Iterator[Running]:
    """One ``celery worker -P threads``; ETA tasks through one producer."""
    from .celery_app import TASK_NAME, make_app  # Celery is optional: the bench extra

    queue, prefix = _celery_queue(config, tag)
    app = make_app(config.broker_url, prefix, queue)
    task = app.tasks[TASK_NAME]
    try:
        with _celery_worker(config, key, tag) as proc:

            def send(tasks: list[Task]) -> None:
                with app.producer_or_acquire() as producer:
                    for i, due in tasks:
                        task.apply_async((i, due), eta=_due(due), producer=producer)

            def submit(tasks: list[Task]) -> None:
                with ThreadPoolExecutor(CELERY_PRODUCERS) as pool:
                    list(pool.map(send, [tasks[k::CELERY_PRODUCERS]
                                         for k in range(CELERY_PRODUCERS)]))

            yield Running(submit, {"worker": proc})
    finally:
        app.pool.force_close_all()
        app.close()
        if config.broker == "redis":
            drop_redis_keys(config.broker_url, prefix)


def _wait_registered(client: Client, proc: subprocess.Popen[bytes]) -> None:
    """Until one ax node is live (the scheduler), or fail after 60 s."""
    deadline = time.monotonic() + 60
    while True:
        with client.store.engine.connect() as conn:
            if conn.execute(text("SELECT count(*) FROM ax_node WHERE stopped_at IS NULL")
                            ).scalar():
                return
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the ax-scheduler did not start; see its log")
        time.sleep(0.1)


@contextmanager
def celery_ax_system(config: Config, key: str, tag: str) -> Iterator[Running]:
    """The ``celery`` system's stock worker, with its ETA calls through ax (issue 16): one
    ``ax-scheduler`` on a scratch database, ``ax.celery.install(app)`` on the producer's app,
    and the same ``apply_async(eta=…)`` calls from the same producer threads."""
    import ax_kombu.celery as axc  # Celery is optional: the bench extra

    from .celery_app import TASK_NAME, make_app

    queue, prefix = _celery_queue(config, tag)
    with scratch_database(f"{config.prefix}{tag}") as url:
        settings = from_env({}, database_url=url, broker_url=config.broker_url,
                            **({"broker_key_prefix": prefix} if prefix else {}))
        client = Client(settings)
        app = make_app(config.broker_url, prefix, queue)
        axc.install(app, client=client)
        task = app.tasks[TASK_NAME]
        try:
            with spawned([("scheduler", f"{tag}-scheduler", ["-l", "WARNING"])],
                         _env(settings, list(config.ax_set)), config.logs) as procs, \
                    _celery_worker(config, key, tag) as worker:
                _wait_registered(client, procs[0])

                def send(tasks: list[Task]) -> None:
                    for i, due in tasks:
                        task.apply_async((i, due), eta=_due(due))

                def submit(tasks: list[Task]) -> None:
                    with ThreadPoolExecutor(CELERY_PRODUCERS) as pool:
                        list(pool.map(send, [tasks[k::CELERY_PRODUCERS]
                                             for k in range(CELERY_PRODUCERS)]))

                yield Running(submit, {"scheduler": procs[0], "worker": worker})
        finally:
            axc.uninstall(app)
            client.close()
            app.close()
            if config.broker == "redis":
                drop_redis_keys(config.broker_url, prefix)


@contextmanager
def polling_system(config: Config, key: str, tag: str) -> Iterator[Running]:
    """:mod:`bench.poller` over a plain table in a scratch database."""
    with scratch_database(f"{config.prefix}{tag}", migrated=False) as url:
        poller.create_table(url)
        cmd = [sys.executable, "-m", "bench.poller", url, "--threads", str(config.threads)]
        env = _plain_env(_ledger_env(config, key))
        with _process(cmd, env, config.logs / f"{tag}-poller.log") as proc:
            yield Running(lambda tasks: poller.insert(url, tasks), {"worker": proc})


@contextmanager
def _peer(config: Config, key: str, tag: str, module: str, args: list[str],
          install: Callable[[str], None], submit: Callable[[str, list[Task]], None]
          ) -> Iterator[Running]:
    """A peer's worker process (``python -m bench.MODULE DSN ARGS``) on a scratch database
    that ``install`` prepared; ``submit(dsn, tasks)`` hands tasks over."""
    with scratch_database(f"{config.prefix}{tag}", migrated=False) as url:
        install(url)
        cmd = [sys.executable, "-m", f"bench.{module}", url, *args]
        env = _plain_env(_ledger_env(config, key))
        with _process(cmd, env, config.logs / f"{tag}-worker.log") as proc:
            yield Running(lambda tasks: submit(url, tasks), {"worker": proc})


@contextmanager
def tight_poller_system(config: Config, key: str, tag: str) -> Iterator[Running]:
    """:mod:`bench.poller` ``--tight`` over a plain table in a scratch database."""
    with _peer(config, key, tag, "poller", ["--tight", "--threads", str(config.threads)],
               poller.create_table, poller.insert) as running:
        yield running


@contextmanager
def pgqueuer_system(config: Config, key: str, tag: str) -> Iterator[Running]:
    """:mod:`bench.pgqueuer_worker` on a scratch database with PgQueuer's schema."""
    from . import pgqueuer_worker  # PgQueuer is optional: the bench extra

    with _peer(config, key, tag, "pgqueuer_worker", ["--concurrency", str(config.threads)],
               pgqueuer_worker.install, pgqueuer_worker.enqueue) as running:
        yield running


@contextmanager
def procrastinate_system(config: Config, key: str, tag: str) -> Iterator[Running]:
    """:mod:`bench.procrastinate_worker` on a scratch database with Procrastinate's schema."""
    from . import procrastinate_app  # Procrastinate is optional: the bench extra

    with _peer(config, key, tag, "procrastinate_worker",
               ["--concurrency", str(config.threads)], procrastinate_app.apply_schema,
               procrastinate_app.defer) as running:
        yield running


SYSTEMS: dict[str, System] = {"ax": ax_system, "celery": celery_system,
                              "celery-ax": celery_ax_system, "polling": polling_system,
                              "tight-poller": tight_poller_system,
                              "pgqueuer": pgqueuer_system,
                              "procrastinate": procrastinate_system}
