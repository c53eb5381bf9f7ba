"""A mypy plugin for typed tasks (:mod:`ax_kombu.tasks`): enable it with
``plugins = ax_kombu.mypy_plugin`` in the ``[mypy]`` section (or ``[tool.mypy]``).

``Task[P, R]`` is generic in its function's ``ParamSpec``, and PEP 612 cannot say the rest:
options beside ``P.kwargs`` are not allowed, and ``P`` keeps the ``ctx`` parameter the
worker fills. At each call of ``enqueue``, ``aenqueue``, ``item`` (of a task or of
``task.options(…)``) and ``schedule``, this plugin takes ``ctx`` out of the signature
and adds the options as keyword-only parameters, typed from
:class:`ax_kombu.task_options.Options`: ``close.enqueue("42")`` for ``order: int`` is an
``arg-type`` error, ``close.enqueue(42, delay=60)`` is clean. Loaded by mypy only.
"""

from __future__ import annotations

from collections.abc import Callable

from mypy.nodes import ARG_STAR2
from mypy.plugin import MethodSigContext, Plugin
from mypy.types import CallableType, FunctionLike, Instance, get_proper_type

#: method fullname → the method (of ``task_options.Options``, which tasks inherit) declaring
#: its options
_METHODS = {f"ax_kombu.tasks.{cls}.{name}": "_enqueue_options"
            for cls in ("Task", "TaskCall") for name in ("enqueue", "aenqueue", "item")}
_METHODS["ax_kombu.tasks.Task.schedule"] = "_schedule_options"


def _options(ctx: MethodSigContext, method: str) -> CallableType | None:
    """The keyword-only options' signature, as ``Options`` declares it (None: not found)."""
    receiver = get_proper_type(ctx.type)
    node = receiver.type.get(method) if isinstance(receiver, Instance) else None
    found = get_proper_type(node.type) if node is not None else None
    return found if isinstance(found, CallableType) else None


def _with_options(ctx: MethodSigContext, method: str) -> FunctionLike:
    """The call's signature without ``ctx``, with the options before any ``**kwargs``."""
    sig = ctx.default_signature
    options = _options(ctx, method)
    kept = [row for row in zip(sig.arg_kinds, sig.arg_names, sig.arg_types, strict=True)
            if row[1] != "ctx"]
    added = [] if options is None else [
        row for row in zip(options.arg_kinds, options.arg_names, options.arg_types, strict=True)
        if row[1] not in (None, "self") and row[1] not in sig.arg_names]
    rows = [r for r in kept if r[0] != ARG_STAR2] + added + [r for r in kept if r[0] == ARG_STAR2]
    return sig.copy_modified(arg_kinds=[r[0] for r in rows], arg_names=[r[1] for r in rows],
                             arg_types=[r[2] for r in rows])


class TypedTasks(Plugin):
    """Adjusts the signatures of typed tasks' enqueue methods at their calls."""

    def get_method_signature_hook(
            self, fullname: str) -> Callable[[MethodSigContext], FunctionLike] | None:
        method = _METHODS.get(fullname)
        if method is None:
            return None
        return lambda ctx: _with_options(ctx, method)


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point."""
    return TypedTasks
