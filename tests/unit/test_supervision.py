from __future__ import annotations

import threading

from ax_kombu.supervision import CrashFlag, supervised


def test_a_thread_that_raises_is_reported_once_with_its_name() -> None:
    flag = CrashFlag()
    reported = threading.Event()

    def crash(name: str, error: BaseException) -> None:
        flag(name, error)
        reported.set()

    def boom() -> None:
        raise RuntimeError("claimer broke")

    thread = supervised(boom, "ax-claimer", crash)
    thread.start()
    thread.join(10)
    assert reported.is_set() and flag.crashed and flag.thread == "ax-claimer"
    assert isinstance(flag.error, RuntimeError)
    flag("ax-other", ValueError())  # the first death is the one remembered
    assert flag.thread == "ax-claimer"


def test_a_thread_that_returns_is_not_a_crash() -> None:
    flag = CrashFlag()
    thread = supervised(lambda: None, "ax-quiet", flag)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and not flag.crashed
