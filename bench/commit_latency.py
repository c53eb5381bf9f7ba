"""How long PostgreSQL takes to commit one small write, over and over (the disk flush).

A staged task's RUNNING commit is done before its trigger time so that this latency, which
on this machine's virtual disk is about a millisecond with rare stalls of a few hundred,
is not part of its lateness (see ``claim_lead_ms``). This measures it on a scratch table:

    .venv/bin/python -m bench.commit_latency [--seconds 30] [--every-ms 10]
"""

from __future__ import annotations

import argparse
import time

import psycopg2

from bench.common import PG_ADMIN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--every-ms", type=float, default=10.0, help="pause between commits")
    args = parser.parse_args()
    conn = psycopg2.connect(PG_ADMIN)
    conn.autocommit = True
    cur = conn.cursor()
    table = f"ax_commit_probe_{time.time_ns()}"
    cur.execute(f"CREATE TABLE {table} (x int)")
    lat: list[float] = []
    try:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            cur.execute(f"INSERT INTO {table} VALUES (1)")  # autocommit: one flush each
            lat.append((time.perf_counter() - t) * 1000.0)
            time.sleep(args.every_ms / 1000.0)
    finally:
        cur.execute(f"DROP TABLE {table}")
        conn.close()
    lat.sort()
    n = len(lat)
    print(f"{n} commits in {args.seconds:g} s: p50 {lat[n // 2]:.2f} ms, p99 "
          f"{lat[int(n * 0.99)]:.2f} ms, p99.9 {lat[int(n * 0.999)]:.2f} ms, max {lat[-1]:.1f} ms;"
          f" over 20 ms: {sum(x > 20 for x in lat)}, over 50 ms: {sum(x > 50 for x in lat)}")


if __name__ == "__main__":
    main()
