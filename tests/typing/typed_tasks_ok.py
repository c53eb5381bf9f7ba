"""Correct uses of typed tasks: ``mypy --strict`` with ``ax_kombu.mypy_plugin`` finds nothing
here (tests/unit/test_typed_mypy.py). Checked, never run."""

from __future__ import annotations

from datetime import timedelta

import ax_kombu as ax


@ax.task("order.close", priority="high", max_retry=3, timeout="30s")
def close(order: int, *, ctx: ax.Context) -> None:
    """Close an unpaid order."""


@ax.task("mail.send")
def send(to: str, subject: str = "", *cc: str, retries: int = 0) -> bool:
    return bool(to)


@ax.task("feed.refresh")
async def refresh(user: int, *, ctx: ax.Context) -> None:
    """An async def task."""


async def producer() -> None:
    task_id: ax.TaskId = await close.aenqueue(42, delay=5)
    await refresh.aenqueue(7, biz_key="u-7")
    await close.options(delay=1).aenqueue(43)
    assert int(task_id) > 0


def uses(ctx: ax.Context) -> None:
    first: ax.TaskId = close.enqueue(42, delay=1800, biz_key="o-42")
    close.enqueue(42, delay=timedelta(minutes=30), connection=None, max_retry=1)
    close.options(delay=1800, biz_key="o-43").enqueue(43)
    ids: list[ax.TaskId] = close.enqueue_many([close.item(1), close.item(2, biz_key="o-2"),
                                               close.options(delay=9).item(3)])
    job: ax.JobView = close.schedule("close.sweep", 0, cron="*/5 * * * *", tz="UTC")
    send.enqueue("a@example.org", "hi", "b@example.org", retries=2, priority="slow")
    send.schedule("mail.hourly", "ops@example.org", every=3600)
    close(42, ctx=ctx)
    ok: bool = send("a@example.org")
    assert first and ids and job and ok
