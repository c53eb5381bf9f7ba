from __future__ import annotations

import threading

from ax_kombu.node.supervision import CrashFlag, watch_threads


def test_a_thread_that_raises_is_reported_once_with_its_name() -> None:
    flag = CrashFlag()
    reported = threading.Event()

    def crash(name: str, error: BaseException) -> None:
        flag(name, error)
        reported.set()

    def boom() -> None:
        raise RuntimeError("claimer broke")

    undo = watch_threads(crash)
    try:
        thread = threading.Thread(target=boom, name="ax-claimer")
        thread.start()
        thread.join(10)
    finally:
        undo()
    assert reported.is_set() and flag.crashed and flag.thread == "ax-claimer"
    assert isinstance(flag.error, RuntimeError)
    flag("ax-other", ValueError())  # the first death is the one remembered
    assert flag.thread == "ax-claimer"


def test_a_thread_that_returns_is_not_a_crash_and_undo_restores_the_hook() -> None:
    before = threading.excepthook
    flag = CrashFlag()
    undo = watch_threads(flag)
    try:
        thread = threading.Thread(target=lambda: None, name="ax-quiet")
        thread.start()
        thread.join(10)
    finally:
        undo()
    assert not flag.crashed and threading.excepthook is before
