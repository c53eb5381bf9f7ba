"""Start and stop as data (:mod:`ax_kombu.node.steps`): steps start in the order listed and
stop in reverse, a failed start stops what had started, a failed stop does not keep the
others from stopping; a timer runs each job at its own interval on one thread."""

from __future__ import annotations

import threading
import time

import pytest

from ax_kombu.node.steps import Blueprint, Call, Job, Timers

pytestmark = pytest.mark.timeout(30)


def recording(log: list[str], name: str, *, fail_start: bool = False,
              fail_stop: bool = False) -> Call:
    def start() -> None:
        if fail_start:
            raise RuntimeError(f"{name} cannot start")
        log.append(f"start {name}")

    def stop() -> None:
        log.append(f"stop {name}")
        if fail_stop:
            raise RuntimeError(f"{name} cannot stop")

    return Call(name, start, stop)


def test_steps_start_in_order_and_stop_in_reverse_once() -> None:
    log: list[str] = []
    blueprint = Blueprint("d", [recording(log, n) for n in ("a", "b", "c")])
    blueprint.start()
    blueprint.stop()
    blueprint.stop()  # a second stop stops nothing again
    assert log == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]


def test_a_step_that_cannot_start_stops_those_started_and_raises() -> None:
    log: list[str] = []
    blueprint = Blueprint("d", [recording(log, "a"), recording(log, "b", fail_start=True),
                                recording(log, "c")])
    with pytest.raises(RuntimeError, match="b cannot start"):
        blueprint.start()
    assert log == ["start a", "stop a"]


def test_a_step_that_fails_to_stop_does_not_keep_the_others_running() -> None:
    log: list[str] = []
    blueprint = Blueprint("d", [recording(log, "a"), recording(log, "b", fail_stop=True)])
    blueprint.start()
    blueprint.stop()
    assert log == ["start a", "start b", "stop b", "stop a"]


def test_timers_run_each_job_at_its_interval_and_a_final_call_at_the_stop() -> None:
    counts = {"fast": 0, "slow": 0, "final": 0}
    fast_runs = threading.Event()

    def fast() -> None:
        counts["fast"] += 1
        if counts["fast"] >= 5:
            fast_runs.set()

    def slow() -> None:
        counts["slow"] += 1

    def flaky() -> None:
        raise OSError("tolerated: run again next time")

    timers = Timers("t", [Job("fast", 0.01, fast), Job("slow", 10.0, slow),
                          Job("flaky", 0.01, flaky)],
                    tolerated=(OSError,), final=lambda: counts.__setitem__("final", 1))
    timers.start()
    assert fast_runs.wait(5.0)
    timers.stop()
    assert counts["slow"] == 0 and counts["final"] == 1  # slow's first time never came
    settled = counts["fast"]
    time.sleep(0.05)
    assert counts["fast"] == settled  # nothing runs after the stop
