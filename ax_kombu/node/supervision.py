"""Supervised daemon threads: a thread that dies takes its process down, loudly.

A daemon whose claimer, dispatcher or result writer died would otherwise keep
heartbeating while doing nothing, and no supervisor (systemd, Kubernetes)
would ever restart it. While ``ax-scheduler`` or ``ax-worker`` runs,
:func:`watch_threads` routes an exception that ends any of its threads to the
node: the error is logged with its traceback, the node stops cold, and the
process exits with :data:`EXIT_CRASHED`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: the exit code of a process one of whose threads died (EX_SOFTWARE)
EXIT_CRASHED = 70

OnCrash = Callable[[str, BaseException], None]


def watch_threads(on_crash: OnCrash) -> Callable[[], None]:
    """Call ``on_crash(thread_name, error)`` when any thread ends with an exception.

    Returns:
        A function that puts the previous ``threading.excepthook`` back.
    """
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit or args.exc_value is None:
            previous(args)
            return
        name = args.thread.name if args.thread is not None else "?"
        on_crash(name, args.exc_value)
        log.critical("a daemon thread died; stopping the process",
                     exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
                     extra={"thread_name": name})

    threading.excepthook = hook

    def undo() -> None:
        threading.excepthook = previous

    return undo


class CrashFlag:
    """Remembers the first thread that died; the daemons read it for their exit code."""

    def __init__(self) -> None:
        self.thread: str | None = None
        self.error: BaseException | None = None

    def __call__(self, name: str, error: BaseException) -> None:
        if self.thread is None:
            self.thread, self.error = name, error

    @property
    def crashed(self) -> bool:
        return self.thread is not None
