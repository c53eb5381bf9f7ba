"""What one task costs PostgreSQL (issue 15): row versions, index entries, WAL and CPU.

An end-to-end burst (:mod:`bench.e2e`'s daemons: one ``ax-scheduler`` + one ``ax-worker``,
a scratch database + Redis) of N no-op tasks due at one instant, measured three ways:

* **WAL records of this database only**, read back with ``pg_walinspect`` (PostgreSQL 15
  contrib, created in the scratch database) every second over the LSN range since
  the last look: every record whose block reference names this database, and the commit
  records of the transactions that wrote them. Counted per relation: heap INSERT / UPDATE
  / HOT_UPDATE (row versions written) and B-tree INSERT_LEAF / INSERT_POST / leaf-level
  SPLIT (index entries written; a split record carries the entry that caused it). Exact
  whatever else the shared server is doing, and split by phase (enqueue, burst).
  The shared server recycles WAL segments after each checkpoint: a range already gone is
  reported ("WAL read errors") and that run's WAL figures are then short.
* **Cumulative statistics** (``pg_stat_user_tables``, ``pg_stat_user_indexes``) read after
  the daemons stopped (their backends flush them on exit), as a cross-check; the number of
  entries each index holds afterwards (``pgstattuple``: live + dead).
* **CPU of this database's backends**: utime + stime from ``/proc/<pid>/stat`` of every
  client backend connected to the scratch database (their pids from ``pg_stat_activity``,
  polled every 0.5 s; a backend born during the run counts from zero), except the probe's
  own connections (``application_name`` ax-bench-probe; they poll with index scans off, so
  they add nothing to ``idx_scan`` either). The WAL writer, checkpointer and background
  writer serve the whole cluster: their CPU is shown apart.

Phases: *idle* (the daemons started, ``--idle`` s with no task), *enqueue* (N tasks by
``enqueue_many``, COPY, batches of 20,000), *burst* (from the end of the enqueue until every
task is final: preload, claim, RUNNING, SUCCESS, and the daemons' idle work during the
``--lead`` wait).

``--variants base,ff80`` (alternating, ``--rounds`` each) tries storage changes in the
scratch database only (never in ax's migrations):

* ``base``: ax's schema as migrated.
* ``ff80``, ``ff60``: ``ax_task`` with that fillfactor (room on each page for a row's next
  versions).

    .venv/bin/python -m bench.pgcost [--n 20000] [--variants base,ff80] [--rounds 2]
                                     [-c high=8,default=256,slow=8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, text

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.store.engine import make_engine

from .common import cpu_s, machine, scratch_database, wait_quiet
from .e2e import _cleanup_redis, daemons, enqueue_burst, wait_ready

PROBE = "ax-bench-probe"
FINAL = "('SUCCESS', 'FAILED', 'CANCELLED')"
AUX = ("walwriter", "checkpointer", "background writer")

VARIANTS: dict[str, list[str]] = {
    "base": [],
    # free room on every page, so that a row's next version can land beside it
    "ff80": ["ALTER TABLE ax_task SET (fillfactor = 80)"],
    "ff60": ["ALTER TABLE ax_task SET (fillfactor = 60)"],
    # (status, trigger_time) without RUNNING: what scans it asks for claimable and
    # DISPATCHING rows; RUNNING is looked up by node (recovery) through (task_type, status)
    "st4": ["DROP INDEX ix_ax_task_status_trigger",
            ("CREATE INDEX ix_ax_task_status_trigger ON ax_task (status, trigger_time) "
             "WHERE status IN ('CREATED', 'DELAYED', 'READY', 'DISPATCHING')")],
}
VARIANTS["st4ff80"] = VARIANTS["st4"] + VARIANTS["ff80"]
VARIANTS["st4ff60"] = VARIANTS["st4"] + VARIANTS["ff60"]
VARIANTS["ff70"] = ["ALTER TABLE ax_task SET (fillfactor = 70)"]
VARIANTS["st4ff70"] = VARIANTS["st4"] + VARIANTS["ff70"]
# the duplicate check's index left out of the update path: what its entries cost a version
# (measured before migration 0012, which moved the pairs to ax_fingerprint: now equal to base)
VARIANTS["nofp"] = ["DROP INDEX IF EXISTS ix_ax_task_fingerprint"]

# This database's WAL records in [a, b): per (resource manager, record type, relfilenode),
# with the commit records of the transactions that wrote here; and where reading stopped.
_WAL = """
WITH r AS MATERIALIZED (
    SELECT end_lsn, xid::text AS xid, resource_manager AS rm, record_type AS rt,
           record_length AS len, fpi_length AS fpi, description AS d,
           substring(block_ref from 'rel [0-9]+/([0-9]+)/') AS dbid,
           substring(block_ref from 'rel [0-9]+/[0-9]+/([0-9]+)') AS rel
      FROM pg_get_wal_records_info(CAST(:a AS pg_lsn), CAST(:b AS pg_lsn))),
mine AS (SELECT DISTINCT xid FROM r WHERE dbid = :db AND xid <> '0')
SELECT rm, rt, COALESCE(rel, ''), (rm = 'Btree' AND rt LIKE 'SPLIT%' AND d LIKE 'level 0,%'),
       COUNT(*), SUM(len), SUM(fpi), (SELECT MAX(end_lsn)::text FROM r),
       SUM(CASE WHEN rt LIKE 'MULTI_INSERT%' THEN CAST(substring(d from '^([0-9]+) tuples')
                                                       AS INT) ELSE 1 END)
  FROM r
 WHERE dbid = :db OR (rm = 'Transaction' AND xid IN (SELECT xid FROM mine))
 GROUP BY 1, 2, 3, 4
"""


def probe_engine(url: str) -> Engine:
    return make_engine(url, isolation_level="AUTOCOMMIT", pool_size=2,
                       connect_args={"application_name": PROBE})


class Watch(threading.Thread):
    """CPU of the scratch database's backends and the cluster's WAL writer, checkpointer and
    background writer (every 0.5 s); this database's WAL records (every ``wal_every_s``)."""

    def __init__(self, url: str, dbname: str, wal_every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.engine = probe_engine(url)
        self.dbname = dbname
        self.wal_every_s = wal_every_s
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.aux_first: dict[int, tuple[str, float]] = {}
        self.aux_last: dict[int, float] = {}
        self.wal: dict[tuple[str, str, str, bool], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self.wal_errors: list[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.seen_once = False
        with self.engine.connect() as conn:
            self.dboid = str(conn.execute(text("SELECT oid FROM pg_database WHERE datname = :d"),
                                          {"d": dbname}).scalar_one())
            self.lsn = str(conn.execute(text("SELECT pg_current_wal_flush_lsn()")).scalar_one())
        self.lsn_start = self.lsn

    def run(self) -> None:
        next_wal = time.monotonic() + self.wal_every_s
        while not self.stopping.wait(0.5):
            self.poll_cpu()
            if time.monotonic() >= next_wal:
                self.fold_wal()
                next_wal = time.monotonic() + self.wal_every_s

    def poll_cpu(self) -> None:
        with self.engine.connect() as conn:
            rows = list(conn.execute(text(
                "SELECT pid, backend_type, datname, application_name FROM pg_stat_activity")))
        with self.lock:
            for pid, kind, db, app in rows:
                now = cpu_s(pid)
                if kind in AUX:
                    self.aux_first.setdefault(pid, (kind, now))
                    self.aux_last[pid] = now
                elif db == self.dbname and kind == "client backend" and app != PROBE:
                    # a backend there at the first look counts from then, later ones from zero
                    self.first.setdefault(pid, now if not self.seen_once else 0.0)
                    if now:
                        self.last[pid] = now
            self.seen_once = True

    def fold_wal(self) -> None:
        """Add the WAL records since the last look (this database's) to the totals."""
        with self.lock, self.engine.connect() as conn:
            end = str(conn.execute(text("SELECT pg_current_wal_flush_lsn()")).scalar_one())
            if end == self.lsn:
                return
            try:
                rows = list(conn.execute(text(_WAL), {"a": self.lsn, "b": end, "db": self.dboid}))
            except Exception as exc:  # noqa: BLE001 - e.g. the range was recycled: say so
                self.wal_errors.append(f"{self.lsn}..{end}: {str(exc).splitlines()[0]}")
                self.lsn = end
                return
            last = None
            for rm, rt, rel, leaf_split, count, size, fpi, last_end, tuples in rows:
                acc = self.wal[(rm, rt.split("+")[0], rel, bool(leaf_split))]
                acc[0] += count
                acc[1] += size
                acc[2] += fpi
                acc[3] += tuples or 0
                last = last_end
            # the next look starts where the last record read ended (none of ours: at end)
            self.lsn = last or end

    def snapshot(self) -> dict[str, Any]:
        self.poll_cpu()
        self.fold_wal()
        with self.lock, self.engine.connect() as conn:
            lsn = str(conn.execute(text("SELECT pg_current_wal_lsn()")).scalar_one())
            cluster = int(conn.execute(text("SELECT pg_wal_lsn_diff(CAST(:b AS pg_lsn), "
                                            "CAST(:a AS pg_lsn))"),
                                       {"a": self.lsn_start, "b": lsn}).scalar_one())
            aux: dict[str, float] = defaultdict(float)
            for pid, (kind, first) in self.aux_first.items():
                aux[kind] += self.aux_last.get(pid, first) - first
            return {"at": time.monotonic(), "load1": os.getloadavg()[0],
                    "cpu": sum(self.last.get(p, f) - f for p, f in self.first.items()),
                    "backends": len(self.first), "aux": dict(aux), "cluster_wal": cluster,
                    "wal": {k: list(v) for k, v in self.wal.items()}}

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)
        self.engine.dispose()


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What happened between snapshots ``a`` and ``b``."""
    wal = {k: [x - y for x, y in zip(v, a["wal"].get(k, [0, 0, 0, 0]), strict=True)]
           for k, v in b["wal"].items()}
    return {"seconds": b["at"] - a["at"], "cpu": b["cpu"] - a["cpu"],
            "aux": {k: v - a["aux"].get(k, 0.0) for k, v in b["aux"].items()},
            "cluster_wal": b["cluster_wal"] - a["cluster_wal"],
            "wal": {k: v for k, v in wal.items() if v[0]}, "load1": b["load1"]}


def relnames(conn: Connection) -> dict[str, str]:
    return {str(r[0]): r[1] for r in conn.execute(text(
        "SELECT relfilenode, relname FROM pg_class WHERE relfilenode <> 0"))}


def wal_summary(phase: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Row versions and index entries written per relation, WAL bytes, in one phase."""
    heap: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    entries: dict[str, int] = defaultdict(int)
    size = fpi = 0
    for (rm, rt, rel, leaf_split), (count, nbytes, fbytes, tuples) in phase["wal"].items():
        size += nbytes
        fpi += fbytes
        name = names.get(rel, rel or "-")
        if rm == "Heap" and rt in ("INSERT", "UPDATE", "HOT_UPDATE", "DELETE"):
            heap[name][rt] += count
        elif rm == "Heap2" and rt == "MULTI_INSERT":
            heap[name]["INSERT"] += tuples  # one record per page of a COPY, "N tuples" each
        elif rm == "Btree" and (rt in ("INSERT_LEAF", "INSERT_POST") or leaf_split):
            entries[name] += count
    return {"heap": {k: dict(v) for k, v in heap.items()}, "entries": dict(entries),
            "wal_bytes": size, "fpi_bytes": fpi}


def table_stats(conn: Connection) -> dict[str, dict[str, int]]:
    conn.execute(text("SELECT pg_stat_clear_snapshot()"))
    return {r[0]: dict(zip(("ins", "upd", "hot", "del", "dead", "live"), r[1:], strict=True))
            for r in conn.execute(text(
                "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, n_dead_tup, "
                "n_live_tup FROM pg_stat_user_tables"))}


def index_stats(conn: Connection) -> dict[str, dict[str, Any]]:
    conn.execute(text("SELECT pg_stat_clear_snapshot()"))
    out = {}
    for table, index, scans, method in conn.execute(text(
            "SELECT s.relname, s.indexrelname, s.idx_scan, a.amname FROM pg_stat_user_indexes "
            "AS s JOIN pg_class AS c ON c.oid = s.indexrelid JOIN pg_am AS a ON a.oid = c.relam")):
        held = None if method not in ("btree", "hash") else conn.execute(text(
            "SELECT tuple_count + dead_tuple_count FROM pgstattuple(CAST(:i AS regclass))"),
            {"i": index}).scalar_one()  # (pgstattuple counts no BRIN index's entries)
        out[index] = {"table": table, "idx_scan": scans, "entries_now": held}
    return out


def one_round(variant: str, k: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"ax_bench_pgcost_{os.getpid()}_{k}"
    with scratch_database(name) as url:
        admin = probe_engine(url)
        with admin.connect() as conn:
            for ddl in ["CREATE EXTENSION pg_walinspect", "CREATE EXTENSION pgstattuple",
                        *VARIANTS[variant]]:
                conn.execute(text(ddl))
            indexdefs = {r[0]: r[1] for r in conn.execute(text(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' "
                "AND tablename IN ('ax_task', 'ax_attempt') ORDER BY tablename, indexname"))}
        settings = from_env({}, database_url=url, broker_url=args.broker,
                            broker_key_prefix=f"axbench{os.getpid()}x{k}:")
        client = Client(settings)
        watch = Watch(url, name)
        watch.start()
        ns = argparse.Namespace(logs=f"{args.logs}/{variant}-{k}", concurrency=args.concurrency,
                                prefetch_multiplier=None, set=[])
        procs_cpu: dict[str, float] = {}
        closed = False
        try:
            with daemons(settings, ns) as procs:
                wait_ready(client, procs)
                s_idle = watch.snapshot()
                time.sleep(args.idle)
                s0 = watch.snapshot()
                trigger = enqueue_burst(client, args.n, args.lead)
                s1 = watch.snapshot()
                cpu0 = {"scheduler": cpu_s(procs[0].pid), "worker": cpu_s(procs[1].pid)}
                deadline = time.monotonic() + args.lead + args.timeout
                with admin.connect() as conn:  # a sequential scan: idx_scan stays the daemons'
                    for off in ("enable_indexscan", "enable_indexonlyscan", "enable_bitmapscan"):
                        conn.execute(text(f"SET {off} = off"))
                    while time.monotonic() < deadline and conn.execute(text(
                            f"SELECT COUNT(*) FROM ax_task WHERE status IN {FINAL}")
                            ).scalar_one() < args.n:
                        time.sleep(0.5)
                s2 = watch.snapshot()
                procs_cpu = {kind: cpu_s(p.pid) - cpu0[kind]
                             for kind, p in zip(("scheduler", "worker"), procs, strict=True)}
            client.close()  # the enqueue's backend too: a backend flushes its statistics on exit
            closed = True
            with admin.connect() as conn:
                time.sleep(1.0)
                names = relnames(conn)
                tables = table_stats(conn)
                indexes = index_stats(conn)
                heap = dict(conn.execute(text(
                    "SELECT table_len, tuple_count, tuple_len, dead_tuple_count, dead_tuple_len, "
                    "free_space FROM pgstattuple('ax_task')")).one()._mapping)
                done = conn.execute(text(
                    "SELECT COUNT(*) FILTER (WHERE status = 'SUCCESS'), "
                    "MAX(finished_at), COUNT(*) FILTER (WHERE attempt > 1) FROM ax_task")).one()
        finally:
            watch.stop()
            if not closed:
                client.close()
            _cleanup_redis(settings)
            admin.dispose()
    phases = {"idle": diff(s_idle, s0), "enqueue": diff(s0, s1), "burst": diff(s1, s2)}
    return {"variant": variant, "round": k, "n": args.n, "success": done[0],
            "redispatched": done[2],
            "tasks_per_s": round(args.n / max(1e-3, (done[1] - trigger) / 1000)),
            "phases": phases, "wal": {p: wal_summary(v, names) for p, v in phases.items()},
            "tables": tables, "indexes": indexes, "heap": heap, "indexdefs": indexdefs,
            "daemon_cpu": procs_cpu, "wal_errors": watch.wal_errors,
            "utc": datetime.now(UTC).strftime("%H:%M:%S")}


# -- the report ------------------------------------------------------------------------------------

def per_task(r: dict[str, Any]) -> dict[str, Any]:
    n = r["n"]
    enq, burst = r["wal"]["enqueue"], r["wal"]["burst"]
    task_enq = enq["heap"].get("ax_task", {})
    task_burst = burst["heap"].get("ax_task", {})
    upd = task_burst.get("UPDATE", 0) + task_enq.get("UPDATE", 0)
    hot = task_burst.get("HOT_UPDATE", 0) + task_enq.get("HOT_UPDATE", 0)
    st = r["tables"].get("ax_task", {})
    task_indexes = [i for i, v in r["indexes"].items() if v["table"] == "ax_task"]
    entries = {i: enq["entries"].get(i, 0) + burst["entries"].get(i, 0) for i in task_indexes}
    idle = r["phases"]["idle"]
    idle_cpu_per_s = idle["cpu"] / max(1e-3, idle["seconds"])
    return {
        "tasks/s (trigger → last SUCCESS)": f"{r['tasks_per_s']:,}",
        "ax_task row versions / task (pg_stat: ins + upd)":
            f"{(st.get('ins', 0) + st.get('upd', 0)) / n:.2f}",
        "  of which updates / task; HOT share": f"{st.get('upd', 0) / n:.2f}; "
                                                f"{st.get('hot', 0) / max(1, st.get('upd', 0)):.1%}",
        "ax_task updates / task from WAL (UPDATE + HOT_UPDATE)": f"{(upd + hot) / n:.2f} "
                                                                  f"({hot} HOT)",
        "ax_task index entries / task (WAL: enqueue + burst)":
            f"{(sum(entries.values())) / n:.2f} ({sum(enq['entries'].get(i, 0) for i in task_indexes) / n:.2f} + "
            f"{sum(burst['entries'].get(i, 0) for i in task_indexes) / n:.2f})",
        "ax_attempt rows written (total)": str(sum(
            sum(v.values()) for p in ("enqueue", "burst")
            for t, v in r["wal"][p]["heap"].items() if t == "ax_attempt")),
        "WAL bytes / task, this database (enqueue + burst)":
            f"{(enq['wal_bytes'] + burst['wal_bytes']) / n:,.0f} "
            f"({enq['wal_bytes'] / n:,.0f} + {burst['wal_bytes'] / n:,.0f})",
        "  of which full-page images": f"{(enq['fpi_bytes'] + burst['fpi_bytes']) / max(1, enq['wal_bytes'] + burst['wal_bytes']):.0%}",
        "WAL bytes / task, whole cluster over the burst (others' too)":
            f"{r['phases']['burst']['cluster_wal'] / n:,.0f}",
        "PostgreSQL CPU µs / task, this database's backends (enqueue + burst)":
            f"{(r['phases']['enqueue']['cpu'] + r['phases']['burst']['cpu']) / n * 1e6:,.0f} "
            f"({r['phases']['enqueue']['cpu'] / n * 1e6:,.0f} + "
            f"{r['phases']['burst']['cpu'] / n * 1e6:,.0f})",
        "  idle cost of the daemons' backends (CPU ms/s), in the burst phase (s)":
            f"{idle_cpu_per_s * 1000:.1f}; {r['phases']['burst']['seconds']:.1f} s",
        "WAL writer / checkpointer / bgwriter CPU s over the burst (cluster)": " / ".join(
            f"{r['phases']['burst']['aux'].get(k, 0.0):.2f}" for k in AUX),
        "worker / scheduler CPU µs / task": f"{r['daemon_cpu'].get('worker', 0) / n * 1e6:,.0f} / "
                                            f"{r['daemon_cpu'].get('scheduler', 0) / n * 1e6:,.0f}",
        "load1 at the end; UTC": f"{r['phases']['burst']['load1']:.2f}; {r['utc']}",
    }


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    out = []
    heads = [f"{r['variant']} #{r['round']}" for r in results]
    rows = [per_task(r) for r in results]
    out.append(f"| per task (N = {args.n:,}) | " + " | ".join(heads) + " |")
    out.append("|---|" + "---|" * len(heads))
    for key in rows[0]:
        out.append(f"| {key} | " + " | ".join(r[key] for r in rows) + " |")
    # per index: entries written per task, idx_scan in the run, entries held afterwards
    out.append("")
    out.append("| index | " + " | ".join(f"{h}: entries/task; idx_scan; held" for h in heads)
               + " |")
    out.append("|---|" + "---|" * len(heads))
    names = sorted({i for r in results for i in r["indexes"]
                    if r["indexes"][i]["table"] in ("ax_task", "ax_attempt", "ax_node",
                                                     "ax_fingerprint", "ax_due")})
    for i in names:
        cells = []
        for r in results:
            v = r["indexes"].get(i)
            if v is None:
                cells.append("—")
                continue
            written = sum(r["wal"][p]["entries"].get(i, 0) for p in ("enqueue", "burst"))
            held = "—" if v["entries_now"] is None else f"{v['entries_now']:,}"
            cells.append(f"{written / r['n']:.2f}; {v['idx_scan']}; {held}")
        out.append(f"| {i} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("| pg_stat_user_tables | " + " | ".join(heads) + " |")
    out.append("|---|" + "---|" * len(heads))
    for t in ("ax_task", "ax_attempt", "ax_node", "ax_id_lease", "ax_fingerprint", "ax_due"):
        out.append(f"| {t}: ins / upd / hot / del / dead | " + " | ".join(
            "{ins} / {upd} / {hot} / {del} / {dead}".format(**r["tables"].get(
                t, dict.fromkeys(("ins", "upd", "hot", "del", "dead"), 0))) for r in results)
            + " |")
    out.append("")
    out.append("ax_task heap afterwards (pgstattuple): " + "; ".join(
        f"{r['variant']} #{r['round']}: {r['heap']['table_len'] // 8192} pages, "
        f"{r['heap']['tuple_count']} live of {r['heap']['tuple_len'] // max(1, r['heap']['tuple_count'])} B, "
        f"{r['heap']['dead_tuple_count']} dead, free {r['heap']['free_space'] // 1024} kB"
        for r in results))
    out.append("")
    out.append("WAL row versions per relation and phase (heap records):")
    for r in results:
        out.append(f"- {r['variant']} #{r['round']}: " + "; ".join(
            f"{p}: " + ", ".join(f"{t} {dict(v)}" for t, v in sorted(r["wal"][p]["heap"].items()))
            for p in ("enqueue", "burst")) + (f" WAL read errors: {r['wal_errors']}"
                                              if r["wal_errors"] else ""))
    for variant in dict.fromkeys(r["variant"] for r in results):
        runs = [r for r in results if r["variant"] == variant]
        cpu = statistics.median((r["phases"]["enqueue"]["cpu"] + r["phases"]["burst"]["cpu"])
                                / r["n"] * 1e6 for r in runs)
        wal = statistics.median((r["wal"]["enqueue"]["wal_bytes"] + r["wal"]["burst"]["wal_bytes"])
                                / r["n"] for r in runs)
        out.append(f"- median {variant}: PostgreSQL CPU {cpu:,.0f} µs/task, WAL {wal:,.0f} B/task")
    out.append("")
    out.append("Indexes (pg_indexes) of the " + results[0]["variant"] + " schema:")
    for i, d in results[0]["indexdefs"].items():
        out.append(f"    {d}")
    for r in results:
        if r["variant"] != results[0]["variant"]:
            changed = {i: d for i, d in r["indexdefs"].items()
                       if results[0]["indexdefs"].get(i) != d}
            out.append(f"Changed in {r['variant']}:")
            out.extend(f"    {d}" for d in changed.values())
            break
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--variants", default="base",
                        help=f"comma-separated, run alternately: {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant")
    parser.add_argument("--lead", type=float, default=15.0)
    parser.add_argument("--idle", type=float, default=5.0, help="idle window before the enqueue")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--concurrency", "-c", default="high=8,default=256,slow=8")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-pgcost-{os.getpid()}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(sorted(unknown))}")
    wait_quiet()
    results = []
    for k in range(args.rounds):
        for variant in variants:
            result = one_round(variant, k + 1, args)
            print(f"  {variant} #{k + 1}: {result['tasks_per_s']:,} tasks/s, "
                  f"load1 {result['phases']['burst']['load1']:.2f}, {result['utc']} UTC",
                  flush=True)
            results.append(result)
    print(f"pgcost: e2e burst of {args.n:,} no-op tasks, 1 scheduler + 1 worker "
          f"-c {args.concurrency}, PostgreSQL 15 + Redis, on {machine()}")
    print(report(results, args))


if __name__ == "__main__":
    main()
