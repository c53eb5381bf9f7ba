"""Issue 24: what a scattered batch costs more at 10,000,000 rows than at 10,000, index by
index, and how much of it is WAL.

``bench.bigtable``'s "enqueue_many, due over 5 days" (each task of a batch due at its own
time in five days) costs more at 10M than at 10k, where a batch due together does not. Such
a task adds an entry at a random place of every index ordered by its trigger time, and at
10M those indexes hold two million waiting tasks. The indexes a task is written to at
enqueue (PostgreSQL): the primary key and the BRIN on ``ax_fingerprint.task_id`` (in id
order, at their end), before migration 0018 ``ix_ax_task_armed`` (at its end: the
transaction id), and three ordered by trigger time: the DELAYED range of
``ix_ax_task_status_trigger``, ``ix_ax_due_time`` and ``ix_ax_fingerprint_probe``.

One 10M and one 10k database filled as ``bench.bigtable`` fills them (the benchmark's own
server, with ``checkpoint_timeout`` at an hour so that no checkpoint falls inside a
measure by chance), then ``--rounds`` rounds; each takes every variant in turn (the order
reversed every other round) on both tables. A variant is the set of those indexes present
(each rebuilt at fillfactor 70 when it comes back, as random inserts leave them):

* ``0017`` — all four: the schema before migration 0018 dropped ``(armed)`` (no reader
  since migration 0016 but previous releases' schedulers);
* ``shipped`` — the schema now;
* ``-waiting`` (the status index over SUCCESS, FAILED and CANCELLED only) — what ax could
  still drop if the waiting states' readers (a first preload round, the overdue probes and
  gauge, the status counts) found them elsewhere;
* ``-waiting -due``, ``-waiting -probe`` and both — what ax cannot drop (the preload's
  band, the duplicate check; without ``probe`` the check is off, ``dedup_window_ms=0``, its
  entries written and never looked up): their share of the cost.

In each, ``enqueue_many`` of ``--enqueue`` tasks in batches of 1,000, scattered and then
due together (``bench.bigtable.enqueue_many``), twice: right after a ``CHECKPOINT`` with
``full_page_writes`` on (a page's first change after a checkpoint logs the whole page: at
10M nearly every page a task touches is such a page, as it is under the default 5-minute
checkpoints for pages written less often than that), and with ``full_page_writes`` off
(diagnostic only, never for production: what the same inserts cost without those images).
Measured: the database backends' CPU per task, tasks/s, and WAL bytes per task (the
server's insert position before and after); medians of the rounds. The tasks are removed
after each measure.

    .venv/bin/python -m bench.scatter_cost [--rows 10000000] [--small 10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, text

from . import bigtable, dedup_index
from .common import PG_ADMIN, private_server

#: each index this bench takes away, as ax ships it (PostgreSQL), at fillfactor 70 (``armed``:
#: as migrations 0011-0017 made it; its column, which migration 0020 dropped, comes back
#: NULL first, as 0018 left it in new rows)
_INDEXES = {
    "armed": "ALTER TABLE ax_task ADD COLUMN IF NOT EXISTS armed BIGINT; "
             "CREATE INDEX ix_ax_task_armed ON ax_task (armed) WITH (fillfactor = 70) "
             "WHERE status IN ('CREATED', 'DELAYED', 'READY')",
    "waiting": "CREATE INDEX ix_ax_task_status_trigger ON ax_task (status, trigger_time) "
               "WITH (fillfactor = 70) WHERE status IN ('CREATED', 'DELAYED', 'READY', "
               "'SUCCESS', 'FAILED', 'CANCELLED')",
    "due": "CREATE INDEX ix_ax_due_time ON ax_due (trigger_time) WITH (fillfactor = 70)",
    "probe": dedup_index.INDEXES["probe"],
}
#: what stands in for ``waiting`` while it is away: the same index over the finished states
_DONE_ONLY = ("CREATE INDEX ix_ax_task_status_trigger ON ax_task (status, trigger_time) "
              "WITH (fillfactor = 70) WHERE status IN ('SUCCESS', 'FAILED', 'CANCELLED')")
_NAMES = {"armed": "ix_ax_task_armed", "waiting": "ix_ax_task_status_trigger",
          "due": "ix_ax_due_time", "probe": "ix_ax_fingerprint_probe"}

#: each variant: the indexes present
VARIANTS: dict[str, frozenset[str]] = {
    "0017": frozenset({"armed", "waiting", "due", "probe"}),
    "shipped": frozenset({"waiting", "due", "probe"}),
    "-waiting": frozenset({"due", "probe"}),
    "-waiting -due": frozenset({"probe"}),
    "-waiting -probe": frozenset({"due"}),
    "-waiting -due -probe": frozenset(),
}
KINDS = ("scattered", "together")
PAGE_IMAGES = ("on", "off")


def _autocommit(engine: Engine, *statements: str) -> list[Any]:
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        results = [conn.execute(text(s)) for s in statements]
        return [r.scalar() if r.returns_rows else None for r in results]


def use(engine: Engine, present: frozenset[str], now: set[str]) -> None:
    """Give ``engine``'s database the indexes ``present`` of this bench's four; ``now``
    (updated) is the set present at the moment."""
    for name in sorted(present ^ now):
        statements = [f"DROP INDEX IF EXISTS {_NAMES[name]}"]
        if name in present:
            statements.append(_INDEXES[name])
        elif name == "waiting":
            statements.append(_DONE_ONLY)
        _autocommit(engine, *statements)
    now.clear()
    now.update(present)
    _autocommit(engine, "VACUUM ANALYZE ax_task, ax_due, ax_fingerprint")


def page_images(engine: Engine, on: bool) -> None:
    """Set ``full_page_writes`` (a reload), then take a checkpoint and check it was taken."""
    wanted = "on" if on else "off"
    before, = _autocommit(engine, "SELECT redo_lsn::text FROM pg_control_checkpoint()")
    _autocommit(engine, f"ALTER SYSTEM SET full_page_writes = {wanted}",
                "SELECT pg_reload_conf()")
    deadline = time.monotonic() + 10
    while _autocommit(engine, "SHOW full_page_writes")[0] != wanted:  # the reload is a signal
        if time.monotonic() > deadline:
            raise RuntimeError(f"full_page_writes is not {wanted} after a reload")
        time.sleep(0.05)
    _autocommit(engine, "CHECKPOINT")
    after, = _autocommit(engine, "SELECT redo_lsn::text FROM pg_control_checkpoint()")
    if after == before:
        raise RuntimeError(f"CHECKPOINT left the redo point at {before}")


def _wal_position(engine: Engine) -> int:
    return int(_autocommit(engine, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')")[0])


Got = dict[tuple[int, str, str, str], list[tuple[float, float, float]]]


def run(args: argparse.Namespace) -> Got:
    """``{(rows, variant, page images, kind): [(PG CPU µs/task, tasks/s, WAL B/task)]}``."""
    got: Got = {}
    settings = {"checkpoint_timeout": "1h", "max_wal_size": "16GB"}
    with ExitStack() as stack:
        admin = (stack.enter_context(private_server(settings=settings))
                 if args.server == "private" else PG_ADMIN)
        tables = [stack.enter_context(bigtable.filled(n, admin))
                  for n in (args.rows, args.small)][::-1]
        present: dict[int, set[str]] = {}
        shipped = tables[0].client.settings
        for t in tables:
            bigtable.warm_up(t)
            present[t.rows] = set()  # so the first use() builds them all at fillfactor 70
        try:
            for r in range(args.rounds):
                for variant, indexes in list(VARIANTS.items())[::1 if r % 2 == 0 else -1]:
                    for t in tables:
                        engine = t.client.store.engine
                        use(engine, indexes, present[t.rows])
                        window = shipped.dedup_window_ms if "probe" in indexes else 0
                        t.client.settings = dataclasses.replace(shipped,
                                                                dedup_window_ms=window)
                        for images in PAGE_IMAGES:
                            page_images(engine, images == "on")
                            for kind in KINDS:
                                start = _wal_position(engine)
                                with t.meter.span() as span:
                                    ids = bigtable.enqueue_many(
                                        t.client, f"{variant}{images}{kind}{r}", args.enqueue,
                                        1000, spread=kind == "scattered")
                                wal = _wal_position(engine) - start
                                bigtable.remove(engine, ids)
                                got.setdefault((t.rows, variant, images, kind), []).append(
                                    (span.cpu / args.enqueue * 1e6, args.enqueue / span.wall,
                                     wal / args.enqueue))
                    print(f"  round {r + 1}: {variant} done", flush=True)
        finally:
            for t in tables:
                t.client.settings = shipped
                page_images(t.client.store.engine, True)
    return got


def report(got: Got, args: argparse.Namespace) -> list[str]:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    lines = [f"# bench.scatter_cost: {args.small:,} against {args.rows:,} rows", "",
             (f"UTC {when}; medians of {args.rounds} rounds, {args.enqueue:,} tasks a measure; "
              "ratio = cost at the big table over the small one's"), ""]
    for kind in KINDS:
        for images in PAGE_IMAGES:
            lines += [f"## {kind}, full_page_writes {images}", "",
                      (f"| indexes | PG CPU µs/task at {args.small:,} | at {args.rows:,} "
                       f"| ratio | tasks/s at {args.small:,} | at {args.rows:,} | ratio "
                       f"| WAL B/task at {args.small:,} | at {args.rows:,} |"),
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for variant in VARIANTS:
                small, big = (got[(n, variant, images, kind)] for n in (args.small, args.rows))
                m = [[statistics.median(x[i] for x in s) for i in range(3)] for s in (small, big)]
                lines.append(f"| {variant} | {m[0][0]:.2f} | {m[1][0]:.2f} | "
                             f"{m[1][0] / m[0][0]:.2f} | {m[0][1]:,.0f} | {m[1][1]:,.0f} | "
                             f"{m[0][1] / m[1][1]:.2f} | {m[0][2]:,.0f} | {m[1][2]:,.0f} |")
            lines.append("")
    lines.append("Rounds (PG CPU µs/task; tasks/s; WAL B/task):")
    for (rows, variant, images, kind), rounds in sorted(got.items()):
        lines.append(f"- {rows:,} {variant} fpw {images} {kind}: "
                     f"{', '.join(f'{c:.1f}' for c, _, _ in rounds)}; "
                     f"{', '.join(f'{w:,.0f}' for _, w, _ in rounds)}; "
                     f"{', '.join(f'{b:,.0f}' for _, _, b in rounds)}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enqueue", type=int, default=10_000, help="tasks per measure")
    parser.add_argument("--server", choices=("private", "shared"), default="private")
    args = parser.parse_args(argv)
    lines = report(run(args), args)
    out = bigtable.RESULTS / (f"scatter-cost-{args.rows}-"
                              f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.md")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
