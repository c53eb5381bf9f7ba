"""The registry of processors: task types mapped to the Python callables that run them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_registry: dict[str, Callable[..., Any]] = {}


def processor(task_type: str) -> Callable[[F], F]:
    """Register the decorated callable as the processor of ``task_type``.

    Example::

        @ax.processor("coupon.grant")
        def grant(payload, ctx): ...
    """
    if not task_type or not isinstance(task_type, str):
        raise ValueError("processor() needs a non-empty task type")

    def register(func: F) -> F:
        _registry[task_type] = func
        return func

    return register


def registered(task_type: str) -> Callable[..., Any] | None:
    """The processor registered for ``task_type``, if any."""
    return _registry.get(task_type)
