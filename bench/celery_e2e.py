"""The Celery countdown scenario at 10,000 tasks: the main suite's
``tests/e2e/test_celery_e2e.py::test_countdown_calls_run_once_each_on_time_in_an_unmodified_celery_worker``
run with N = 10,000, due 30 s + 30 s · i / N after production began.

    python -m bench.celery_e2e [--n 10000] [--lead 30] [--spread 30] [--claim-lead-ms MS]

Same processes and the same assertions as the test (two ``ax-scheduler`` s, a stock
``celery worker -P threads -c 8`` on Redis, PostgreSQL as ax's store; every call run exactly
once, none early, ax's claim − due p99 ≤ 250 ms, start − due p99 ≤ 3 s), at the count issue
16 named. The main suite runs 1,000 over 5 s, which exercises the same paths in a tenth of
the time; this is the load figure. It needs the test servers (PostgreSQL, Redis), fails
when one is missing, and prints the test's line of figures (produced/s, lateness p50/p99/max,
claimed − due) for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = ("tests/e2e/test_celery_e2e.py::"
        "test_countdown_calls_run_once_each_on_time_in_an_unmodified_celery_worker")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.celery_e2e",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=10_000, help="apply_async calls")
    parser.add_argument("--lead", type=float, default=30.0,
                        help="seconds from the start of production to the first due time")
    parser.add_argument("--spread", type=float, default=30.0,
                        help="seconds the due times cover")
    parser.add_argument("--claim-lead-ms", type=int, default=None,
                        help="the schedulers' claim_lead_ms (default: ax's)")
    args = parser.parse_args(argv)
    env = {**os.environ, "AX_REQUIRE_SERVICES": "1", "AX_CELERY_E2E_N": str(args.n),
           "AX_CELERY_E2E_LEAD_S": str(args.lead), "AX_CELERY_E2E_SPREAD_S": str(args.spread)}
    if args.claim_lead_ms is not None:
        env["AX_CELERY_E2E_CLAIM_LEAD_MS"] = str(args.claim_lead_ms)
    cmd = [sys.executable, "-m", "pytest", TEST, "-p", "no:cacheprovider", "-s", "-q",
           "-o", "addopts=--strict-markers"]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
