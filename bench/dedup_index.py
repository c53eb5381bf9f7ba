"""Issue 24: the duplicate check's index, A/B on the same tables — migration 0015's hash index
on the fingerprint (looked up by fingerprint) against 0017's B-tree on the probe (looked up
by probe: :data:`ax_kombu.store.schema.PROBE_SQL`).

One 10,000,000-row and one 10,000-row database filled as ``bench.bigtable`` fills them (on
the benchmark's own server by default), then ``--rounds`` rounds; each round takes both
designs in turn (the order alternating from round to round) on both tables: the index of
that design built afresh (the B-tree at fillfactor 70, as random inserts leave one), the
table vacuumed and a ``CHECKPOINT`` taken, and the lookup switched (the hash design's lookup
is 0015's query, kept here), then ``enqueue_many`` of ``--enqueue`` tasks in batches of
1,000 twice: due a day ahead, a batch within 17 minutes ("together"), and each task at its
own time over five days ("scattered": no locality for either index). Measured by the
database backends' CPU per task and by tasks/s (medians of the rounds); the tasks are
removed after each measure.

    .venv/bin/python -m bench.dedup_index [--rows 10000000] [--small 10000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from sqlalchemy import Connection, Engine, text

from ax_kombu.store import enqueue as task_store

from . import bigtable
from .common import PG_ADMIN, private_server

#: 0015's lookup, by fingerprint through the hash index
_BY_FINGERPRINT = text(
    "SELECT f.fingerprint, f.trigger_time, f.task_id FROM ax_fingerprint AS f "
    "JOIN ax_task AS t ON t.task_id = f.task_id WHERE f.fingerprint = ANY(CAST(:fps AS TEXT[])) "
    "AND f.trigger_time > :lo AND f.trigger_time < :hi AND t.status <> 'CANCELLED'")
#: each design's index (the B-tree at fillfactor 70, as random inserts leave it); the probe's
#: is bench.scatter_cost's too
INDEXES = {
    "hash": "CREATE INDEX ix_ax_fingerprint_hash ON ax_fingerprint USING hash (fingerprint)",
    "probe": (f"CREATE INDEX ix_ax_fingerprint_probe ON ax_fingerprint "
              f"(({task_store.PROBE_SQL.format(t='')})) WITH (fillfactor = 70)"),
}
_PROBE_LOOKUP = task_store._load_dedup


def _hash_lookup(conn: Connection, rows: Sequence[dict[str, Any]], window_ms: int) -> Any:
    """The check as 0015 made it: the biz keys as now, the fingerprints by value."""
    found = _PROBE_LOOKUP(conn, rows, 0)
    if window_ms > 0:
        times = [r["trigger_time"] for r in rows]
        for fp, when, task_id in conn.execute(_BY_FINGERPRINT, {
                "fps": sorted({r["fingerprint"] for r in rows}),
                "lo": min(times) - window_ms, "hi": max(times) + window_ms}):
            found.by_fp.setdefault(fp, []).append((when, task_id))
    found.window_ms = window_ms
    return found


def use(engine: Engine, design: str) -> None:
    """Give ``ax_fingerprint`` the index of ``design`` and ax the lookup that goes with it."""
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX IF EXISTS ix_ax_fingerprint_probe"))
        conn.execute(text("DROP INDEX IF EXISTS ix_ax_fingerprint_hash"))
        conn.execute(text(INDEXES[design]))
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text("VACUUM ANALYZE ax_fingerprint"))
        conn.execute(text("CHECKPOINT"))
    task_store._load_dedup = (  # type: ignore[assignment]
        _hash_lookup if design == "hash" else _PROBE_LOOKUP)


def run(args: argparse.Namespace) -> dict[tuple[int, str, str], list[tuple[float, float]]]:
    """``{(rows, design, batch kind): [(PG CPU µs/task, tasks/s) per round]}``."""
    got: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    with ExitStack() as stack:
        admin = stack.enter_context(private_server()) if args.server == "private" else PG_ADMIN
        tables = [stack.enter_context(bigtable.filled(n, admin))
                  for n in (args.rows, args.small)][::-1]
        for t in tables:
            bigtable.warm_up(t)
        try:
            for r in range(args.rounds):
                for design in ("hash", "probe")[::1 if r % 2 == 0 else -1]:
                    for t in tables:
                        use(t.client.store.engine, design)
                        for kind in ("together", "scattered"):
                            with t.meter.span() as span:
                                ids = bigtable.enqueue_many(t.client, f"{design}{kind}{r}",
                                                            args.enqueue, 1000,
                                                            spread=kind == "scattered")
                            bigtable.remove(t.client.store.engine, ids)
                            got.setdefault((t.rows, design, kind), []).append(
                                (span.cpu / args.enqueue * 1e6, args.enqueue / span.wall))
                print(f"  round {r + 1} of {args.rounds} done", flush=True)
        finally:
            task_store._load_dedup = _PROBE_LOOKUP  # type: ignore[assignment]
    return got


def report(got: dict[tuple[int, str, str], list[tuple[float, float]]],
           args: argparse.Namespace) -> list[str]:
    head = (f"| batch | index | PG CPU µs/task at {args.small:,} | at {args.rows:,} | ratio "
            f"| tasks/s at {args.small:,} | at {args.rows:,} | ratio |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for kind in ("together", "scattered"):
        for design in ("hash", "probe"):
            small, big = got[(args.small, design, kind)], got[(args.rows, design, kind)]
            cpu = [statistics.median(x[0] for x in s) for s in (small, big)]
            rate = [statistics.median(x[1] for x in s) for s in (small, big)]
            lines.append(f"| {kind} | {design} | {cpu[0]:.2f} | {cpu[1]:.2f} | "
                         f"{cpu[1] / cpu[0]:.2f} | {rate[0]:,.0f} | {rate[1]:,.0f} | "
                         f"{rate[0] / rate[1]:.2f} |")
    lines.append("")
    for (rows, design, kind), rounds in sorted(got.items()):
        lines.append(f"- {rows:,} {design} {kind}: PG CPU µs/task "
                     f"{', '.join(f'{c:.1f}' for c, _ in rounds)}; tasks/s "
                     f"{', '.join(f'{w:,.0f}' for _, w in rounds)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--enqueue", type=int, default=20_000, help="tasks per measure")
    parser.add_argument("--server", choices=("private", "shared"), default="private")
    args = parser.parse_args()
    print("\n".join(report(run(args), args)))


if __name__ == "__main__":
    main()
