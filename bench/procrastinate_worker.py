"""The worker of the Procrastinate peer of :mod:`bench.run` (``procrastinate``): one
Procrastinate 3.10 worker running the shared body (the app: :mod:`bench.procrastinate_app`).

``app.run_worker_async`` in an open app, with ``concurrency`` CONCURRENCY (default 16),
``listen_notify`` on (the default: a deferred job wakes the worker) and
``fetch_job_polling_interval`` POLL s (default 0.05). A job scheduled for later sends no
notification when it comes due, so that interval is the worker's clock for it; the docs
give it no lower bound (it is the "maximum time (in seconds) between database job polls"),
and 50 ms is the tight poller's idle sleep. Procrastinate runs a sync task "in a thread"
through ``asgiref.sync_to_async`` (docs, *Asynchronous operations & concurrency*), i.e. on
the event loop's default executor, here a pool of CONCURRENCY threads. Procrastinate's own
signal handlers stop the worker gracefully on SIGINT or SIGTERM.

    python -m bench.procrastinate_worker DSN [--concurrency 16] [--poll-s 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor

from .procrastinate_app import make_app


async def work(dsn: str, concurrency: int, poll_s: float) -> None:
    """Run one worker until SIGINT or SIGTERM."""
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(concurrency, thread_name_prefix="procrastinate"))
    app, _ = make_app(dsn, concurrency)
    async with app.open_async():
        await app.run_worker_async(concurrency=concurrency, fetch_job_polling_interval=poll_s,
                                   listen_notify=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dsn")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--poll-s", type=float, default=0.05)
    args = parser.parse_args()
    asyncio.run(work(args.dsn, args.concurrency, args.poll_s))


if __name__ == "__main__":
    main()
