"""Recurring jobs, declared next to their processors with ``@ax.periodic``.

``ax-worker -A recurring_tasks`` (or ``ax-scheduler -A recurring_tasks``) writes these jobs
to the store when it starts — an idempotent upsert by name, so every process of every
deploy may do it. Any number of ``ax-scheduler`` nodes then fire each occurrence exactly
once; ``ax jobs list`` shows them, ``ax jobs pause demo.tick`` stops one.

The demo (``scripts/demo.sh``) loads this module and prints the ticks it saw.
"""

from __future__ import annotations

from typing import Any

import ax_kombu as ax


@ax.periodic(every=1, name="demo.tick", priority="high")
def tick(payload: Any, ctx: Any) -> None:
    """Every second. ``ctx.scheduled_at`` is the occurrence (epoch ms), ``ctx.job`` the job."""


@ax.periodic(cron="0 8 * * *", tz="Asia/Shanghai", name="report.daily", misfire="fire_once",
             priority="slow", timeout_ms=600_000)
def daily_report(payload: Any, ctx: Any) -> None:
    """08:00 in Shanghai every day; after an outage that spans 08:00 it runs once, late."""
