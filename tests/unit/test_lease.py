"""The worker's lease: a staged run starts only while a beat proves the incarnation live."""

from __future__ import annotations

import threading

from ax_kombu.core.lease import Lease


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_confirmed_beat_covers_the_lease_from_when_it_was_sent() -> None:
    clock = Clock()
    lease = Lease(10.0, clock)
    assert not lease.valid()  # nothing confirmed yet
    lease.confirm(sent_at=98.0, incarnation=1)
    assert lease.valid()
    clock.now = 107.9
    assert lease.valid()
    clock.now = 108.0  # 10 s after the beat was sent, not after its reply
    assert not lease.valid()


def test_a_paused_process_finds_its_lease_run_out_until_the_next_beat() -> None:
    clock = Clock()
    lease = Lease(10.0, clock)
    lease.confirm(clock.now, 1)
    clock.now += 25.0  # SIGSTOP for 25 s: the monotonic clock went on
    assert not lease.valid() and not lease.wait(1, 0.01)
    lease.confirm(clock.now, 1)
    assert lease.valid()


def test_revoking_ends_the_lease_until_the_next_confirm() -> None:
    clock = Clock()
    lease = Lease(10.0, clock)
    lease.confirm(clock.now, 1)
    lease.revoke()
    assert not lease.valid()
    lease.confirm(clock.now + 1.0, 1)
    assert lease.valid()


def test_a_waiting_start_is_woken_by_the_confirm() -> None:
    clock = Clock()
    lease = Lease(10.0, clock)
    woke = threading.Event()

    def start() -> None:
        if lease.wait(1, 5.0):
            woke.set()

    thread = threading.Thread(target=start)
    thread.start()
    lease.confirm(clock.now, 1)
    thread.join(5.0)
    assert woke.is_set()


def test_a_run_fenced_under_an_earlier_incarnation_never_starts() -> None:
    clock = Clock()
    lease = Lease(10.0, clock)
    lease.confirm(clock.now, incarnation=5)
    assert lease.covers(5) is True
    lease.revoke()  # declared dead: nothing starts ...
    assert lease.covers(5) is None
    lease.confirm(clock.now, incarnation=9)  # ... and after registering anew, what the old
    assert lease.covers(5) is False           # incarnation fenced never does
    assert lease.covers(9) is True
    assert lease.covers(10) is None  # fenced under a newer one than confirmed: wait for it
    assert not lease.wait(10, 0.01)  # and a wait for it does not return at once
    clock.now += 11.0
    assert lease.covers(9) is None  # run out: wait for the next beat
