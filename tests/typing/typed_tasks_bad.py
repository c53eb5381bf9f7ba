"""Wrong uses of typed tasks: ``mypy --strict`` with ``ax_kombu.mypy_plugin`` must report an
error on each line marked ``# E: <code>`` and on no other (tests/unit/test_typed_mypy.py).
Checked, never run."""

from __future__ import annotations

import ax_kombu as ax


@ax.task("order.close", priority="high", max_retry=3, timeout="30s")
def close(order: int, *, ctx: ax.Context) -> None:
    """Close an unpaid order."""


def uses() -> None:
    close.enqueue("42")  # E: arg-type
    close.enqueue()  # E: call-arg
    close.enqueue(42, delay="soon")  # E: arg-type
    close.enqueue(42, nope=1)  # E: call-arg
    close.enqueue(42, ctx=None)  # E: call-arg
    close.options(delay=5).enqueue("42")  # E: arg-type
    close.item(order="42")  # E: arg-type
    close.schedule("close.sweep", "42", cron="* * * * *")  # E: arg-type
    close(42)  # E: call-arg
