"""The main job on the embedded default: a scheduler and a worker, tasks firing on time.

Runs in a fresh temporary folder with no AX_* settings at all, so it uses the
defaults: a SQLite store and ax's SQLite broker transport, no server. It starts
``ax-scheduler`` and ``ax-worker -Q high,default,slow -A demo_tasks -A recurring_tasks``,
enqueues tasks due over the next few seconds (100 coupons due at the same instant among
them), prints each one as it runs with its lateness (start − trigger), shows the
recurring job ``demo.tick`` (every second, declared with ``@ax.periodic`` in
``recurring_tasks.py``) firing once per second, then stops both daemons with SIGTERM (a
warm shutdown).

    python examples/demo.py
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def start(args: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    with open(log, "wb") as out:
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="ax-demo-"))
    os.chdir(workdir)
    for key in [k for k in os.environ if k.startswith("AX_")]:
        del os.environ[key]
    import ax_kombu as ax

    print(f"ax demo in {workdir} (SQLite store + SQLite broker, no server)")
    daemons = [start([str(BIN / "ax-scheduler"), "-l", "WARNING"], workdir,
                     workdir / "scheduler.log"),
               start([str(BIN / "ax-worker"), "-Q", "high,default,slow", "-A", "demo_tasks",
                      "-A", "recurring_tasks", "-l", "WARNING"], workdir, workdir / "worker.log")]
    try:
        ids = enqueue(ax)
        ok = watch(ax, ids, deadline=time.monotonic() + 90)
        ok = ticks(deadline=time.monotonic() + 30) and ok
    finally:
        for daemon in daemons:
            daemon.send_signal(signal.SIGTERM)
        codes = [daemon.wait(60) for daemon in daemons]
    print(f"scheduler and worker stopped warm (exit codes {codes[0]}, {codes[1]})")
    if ok and codes == [0, 0]:
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    print(f"logs kept in {workdir}")
    return 1


def enqueue(ax: object) -> list[int]:
    import ax_kombu

    now = ax_kombu.client().store.now_ms()
    instant = datetime.fromtimestamp((now // 1000 + 3), UTC)  # the next whole second + 2
    items = [{"task_type": "coupon.grant", "payload": {"user": u}, "run_at": instant,
              "priority": "high"} for u in range(100)]
    items += [{"task_type": "order.close", "payload": {"order": o}, "delay": 1 + o / 2}
              for o in range(8)]
    items.append({"task_type": "push.flaky", "payload": {"user": 1}, "delay": 1.5,
                  "max_retry": 2, "priority": "slow"})
    ids = [int(i) for i in ax_kombu.enqueue_many(items)]
    print(f"enqueued {len(ids)} tasks: 100 coupons due at {instant:%H:%M:%S.%f}"[:-3]
          + ", 8 order closes, 1 flaky push")
    return ids


def watch(ax: object, ids: list[int], deadline: float) -> bool:
    """Print each task as it finishes: when it was due, how late it started, the outcome."""
    import ax_kombu

    shown: set[int] = set()
    coupons_shown = 0
    views = [ax_kombu.get(i) for i in ids]
    while time.monotonic() < deadline:
        views = [ax_kombu.get(i) for i in ids]
        for v in views:
            if v.status.value not in FINISHED or v.task_id in shown:
                continue
            shown.add(v.task_id)
            if v.task_type == "coupon.grant":
                coupons_shown += 1
                if coupons_shown > 3:
                    continue
            retried = f", after {v.retry_count} retry ({v.last_error})" if v.retry_count else ""
            print(f"  {v.task_type:<13} due {_clock(v.trigger_time)}  started "
                  f"{v.started_at - v.trigger_time:+4d} ms  {v.status.value}{retried}")
        if len(shown) == len(ids):
            break
        time.sleep(0.05)
    coupon_late = sorted(v.started_at - v.trigger_time for v in views
                         if v.task_type == "coupon.grant" and v.started_at is not None)
    done = sum(v.status.value == "SUCCESS" for v in views)
    if coupon_late:
        print(f"  ... 100 coupons due at the same instant: started p50 "
              f"{coupon_late[len(coupon_late) // 2]} ms, max {coupon_late[-1]} ms late")
    print(f"{done}/{len(views)} tasks SUCCESS")
    return done == len(views)


def ticks(deadline: float, wanted: int = 5) -> bool:
    """Wait for ``wanted`` runs of the every-second job; print them; True if each
    occurrence ran once, in order, one second apart."""
    import ax_kombu

    client = ax_kombu.client()
    done: list[ax_kombu.TaskView] = []
    while time.monotonic() < deadline:
        done = [t for t in client.occurrences("demo.tick", 50) if t.status.value == "SUCCESS"]
        if len(done) >= wanted:
            break
        time.sleep(0.1)
    done.sort(key=lambda t: t.scheduled_at or 0)
    for t in done[-wanted:]:
        assert t.scheduled_at is not None and t.started_at is not None
        print(f"  demo.tick     due {_clock(t.scheduled_at)}  started "
              f"{t.started_at - t.scheduled_at:+4d} ms  SUCCESS")
    times = [t.scheduled_at or 0 for t in done]
    steady = len(times) >= wanted and all(b - a == 1000 for a, b in pairwise(times))
    print(f"recurring job demo.tick (every second): {len(times)} occurrences ran, "
          f"{'each once, 1 s apart' if steady else 'NOT one per second'}")
    return steady


FINISHED = ("SUCCESS", "FAILED", "CANCELLED")


def _clock(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%H:%M:%S.%f")[:-3]


if __name__ == "__main__":
    sys.exit(main())
