"""Supervised daemon threads: a thread that dies takes its process down, loudly.

A daemon whose claimer, dispatcher or result writer died would otherwise keep
heartbeating while doing nothing, and no supervisor (systemd, Kubernetes)
would ever restart it. Every long-lived thread of ``ax-scheduler`` and
``ax-worker`` is started through :func:`supervised`: if its target raises,
the error is logged with its traceback and ``on_crash`` is called, which
makes the node stop cold and its process exit with :data:`EXIT_CRASHED`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: the exit code of a process one of whose threads died (EX_SOFTWARE)
EXIT_CRASHED = 70

OnCrash = Callable[[str, BaseException], None]


def supervised(target: Callable[[], None], name: str, on_crash: OnCrash) -> threading.Thread:
    """A daemon thread running ``target``; if it raises, ``on_crash(name, error)`` is called.

    The thread is returned unstarted.
    """

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 — any death of the thread is reported
            on_crash(name, exc)
            log.critical("a daemon thread died; stopping the process",
                         exc_info=exc, extra={"thread_name": name})

    return threading.Thread(target=run, name=name, daemon=True)


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
