"""The report of :mod:`bench.run`: the table, same-run ratios, the JSON and the PNG."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from .common import PG_ADMIN, machine
from .e2e import ROOT
from .systems import Config

COLUMNS = [("system", "system"), ("n", "n"), ("ran", "ran"), ("early", "early"),
           ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"), ("max_ms", "max ms"),
           ("first_ms", "first ms"), ("tasks_per_s", "tasks/s"),
           ("worker_rss_peak_mb", "worker RSS peak MB"), ("enqueue_s", "hand-over s")]
RATIO_KEYS = ["p50_ms", "p99_ms", "max_ms", "first_ms"]


def ratios(results: Sequence[dict[str, Any]], base: str = "ax") -> list[dict[str, Any]]:
    """Per repeat, each other system's figure ÷ ``base``'s (above 1: ``base`` is better)."""
    out = []
    for repeat in sorted({r["repeat"] for r in results}):
        row = {r["system"]: r for r in results if r["repeat"] == repeat}
        if base not in row:
            continue
        for system, res in row.items():
            if system == base:
                continue
            out.append({"repeat": repeat, "system": system, **{
                key: _ratio(res.get(key), row[base].get(key)) for key in RATIO_KEYS}})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 1)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 10 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def table(results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the runs."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for res in results:
        cells = [_cell(res.get(key, "—")) for key, _ in COLUMNS]
        cells[0] += f" #{res['repeat'] + 1}" if res["repeat"] else ""
        cells[-1] += " (late!)" if res["late_handover"] else ""
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of :func:`ratios` (other ÷ ax)."""
    lines = ["| other ÷ ax | " + " | ".join(RATIO_KEYS) + " |", "|" + "---|" * 5]
    for row in rows:
        name = row["system"] + (f" #{row['repeat'] + 1}" if row["repeat"] else "")
        lines.append(f"| {name} | " + " | ".join(
            "—" if row[k] is None else f"{row[k]}×" for k in RATIO_KEYS) + " |")
    return "\n".join(lines)


def versions(config: Config) -> dict[str, str]:
    """Versions of what ran: Python, libraries, servers, this checkout."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("kombu", "celery", "redis", "sqlalchemy", "psycopg2-binary", "matplotlib"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    client = redis.Redis.from_url(config.redis_url)
    out["redis_server"] = str(client.info("server")["redis_version"])
    client.close()
    out["postgresql"] = _postgres_version()
    if config.broker == "rabbitmq":
        from kombu import Connection

        with Connection(config.broker_url) as conn:
            conn.connect()
            out["rabbitmq"] = conn.connection.server_properties.get("version", "?")
    git = ["git", "-C", str(ROOT)]
    out["ax_commit"] = subprocess.run([*git, "rev-parse", "--short", "HEAD"], text=True,
                                      capture_output=True, check=False).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "ax_kombu"], text=True,
                           capture_output=True, check=False).stdout.split("\n")
    if any(dirty):  # the daemons run this checkout's ax_kombu, uncommitted edits included
        out["ax_commit"] += f" + uncommitted changes in {sum(map(bool, dirty))} ax_kombu files"
    return out


def _postgres_version() -> str:
    import psycopg2

    with psycopg2.connect(PG_ADMIN) as conn, conn.cursor() as cur:
        cur.execute("SHOW server_version")
        row = cur.fetchone()
    conn.close()
    return str(row[0]) if row else "?"


def report(results: list[dict[str, Any]], config: Config, args: argparse.Namespace,
           started: datetime) -> None:
    """Print the tables; write the JSON and the PNG."""
    rows = ratios(results)
    command = "python -m bench run " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["run"]
                                                  else sys.argv[1:])
    print(f"\n{args.scenario} on {config.broker}, {machine()}, {started:%Y-%m-%d %H:%M} UTC")
    print(table(results))
    if rows:
        print("\n" + ratio_table(rows))
    stamp = f"{started:%Y%m%dT%H%M%SZ}"
    name = f"{args.scenario}-{config.broker}"
    meta = {"command": command, "scenario": args.scenario, "broker": config.broker,
            "threads": config.threads, "ax_concurrency": config.ax_concurrency or "default",
            "ax_set": list(config.ax_set), "ax_processes": config.ax_processes or "auto",
            "n": args.n, "rate": args.rate, "lead_s_at_least": args.lead,
            "started": started.isoformat(), "machine": machine(), "versions": versions(config),
            "ratios": rows}
    out = Path(args.out) / f"{name}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k != "lateness_ms"}
            | {"lateness_quantiles_ms": _quantiles(r["lateness_ms"])} for r in results]
    out.write_text(json.dumps({**meta, "runs": slim}, indent=1) + "\n")
    print(f"\nJSON: {out}")
    if args.img:
        from .plots import plot

        title = (f"{args.scenario}: {args.n:,} tasks"
                 + {"burst": " due at one instant",
                    "backlog": " due as they are handed over"}.get(args.scenario,
                                                                   f" at {args.rate:g}/s")
                 + (f", handed over {args.delay:g} s ahead" if args.scenario == "steady" else "")
                 + f", {config.broker}, {machine().split(',')[0]}, {started:%Y-%m-%d %H:%M} UTC")
        print("PNG:", plot(results, title, Path(args.img) / f"bench-{name}.png"))


def _quantiles(late: Sequence[float], points: int = 200) -> list[float]:
    """``points`` + 1 evenly spaced quantiles (0 … 1) of a sorted list, for a CDF."""
    if not late:
        return []
    return [round(late[min(len(late) - 1, round(k * (len(late) - 1) / points))], 3)
            for k in range(points + 1)]
