"""``python -m bench COMMAND …``: the benchmarks that have a command here.

    python -m bench run --scenario burst|spread|steady …
        ax, Celery ETA and 200 ms table polling side by side (bench/run.py)
    python -m bench async-burst [--n 10000] [--modes async,sync] …
        async def processors on the worker's event loop vs sync ones (bench/async_burst.py)
    python -m bench aio-enqueue [--n 10000] [--concurrency 50] [--batch 1000] …
        ax_kombu.aio's enqueue throughput vs the sync API's (bench/aio_enqueue.py)
    python -m bench heartbeat-cost [--intervals 1,5] [--seconds 30] [--workers 2]
        the heartbeats' writes and commits per second per node, idle (bench/heartbeat_cost.py)

The single-system benchmarks keep their own entry points (``python -m bench.e2e``,
``python -m bench.scheduler``, …).
"""

from __future__ import annotations

import sys

COMMANDS = {"run": "ax, Celery ETA and 200 ms table polling side by side (bench.run)",
            "async-burst": "10,000 tasks awaiting 100 ms: async def vs sync (bench.async_burst)",
            "aio-enqueue": "async enqueue throughput vs the sync API (bench.aio_enqueue)",
            "heartbeat-cost": "heartbeat writes per second per node, idle (bench.heartbeat_cost)"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip() if __doc__ else "", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "aio-enqueue":
        from .aio_enqueue import main as aio_enqueue

        aio_enqueue(argv[1:])
        return 0
    if argv[0] == "heartbeat-cost":
        from .heartbeat_cost import main as heartbeat_cost

        heartbeat_cost(argv[1:])
        return 0
    if argv[0] == "async-burst":
        from .async_burst import main as async_burst

        async_burst(argv[1:])
        return 0
    from .run import main as run

    run(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
