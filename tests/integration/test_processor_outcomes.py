"""What a failure means, on PostgreSQL with a real worker (issue 37).

A processor raises ``ax.Retry(delay=…)``, ``ax.Snooze(s)`` or ``ax.Discard(reason)``, or is
registered with ``retry_on`` and its own ``ax.Backoff``; a callback answers 404, 429 or 503
with ``Retry-After``. Each test checks the task row (status, retry_count, attempt, the new
trigger time against the run's recorded end) and the attempt history's outcome kinds. As in
test_worker.py the scheduler's part is done by hand: a retried or snoozed task is claimed
and published again once the database clock says it is due. One broker (Redis) is enough
here: what a run's end means is decided after the broker's part is over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest

from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status

from .. import procs_worker
from ..loopback_http import serving
from .harness import eventually
from .test_worker import Dispatch, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def settings(pg_url: str, redis_broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, retry_backoff_base_ms=300,
                    retry_backoff_max_ms=5000, retry_backoff_jitter=0.5,
                    heartbeat_interval_s=0.2, worker_grace_s=10, max_snoozes=2,
                    callback_allow_hosts="127.0.0.1", **redis_broker)


@pytest.fixture
def dispatch(settings: Settings) -> Iterator[Dispatch]:
    d = Dispatch(settings)
    yield d
    d.close()


def _ended(dispatch: Dispatch, task_id: int, runs: int) -> bool:
    """``runs`` runs of the task have ended and been written (history or final row)."""
    view = dispatch.view(task_id)
    return len(view.attempts) >= runs and view.status is not Status.RUNNING


def _run_again_when_due(dispatch: Dispatch, task_id: int) -> None:
    """The scheduler's part: once the task is due on the database clock, claim and publish
    it again."""
    view = dispatch.view(task_id)
    assert view.status is Status.DELAYED
    eventually(lambda: dispatch.client.store.now_ms() >= view.trigger_time, what="due")
    dispatch.dispatch([task_id])


def _outcomes(dispatch: Dispatch, task_id: int) -> list[str]:
    return [a.outcome for a in dispatch.view(task_id).attempts]


def _delay_after_last_run(dispatch: Dispatch, task_id: int) -> int:
    """The new trigger time minus the recorded end of the run that set it (ms)."""
    view = dispatch.view(task_id)
    return view.trigger_time - view.attempts[-1].finished_at


def test_retry_with_a_delay_is_due_that_long_after_the_run_ended(
        settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.retry_in", {"s": 1.5}, max_retry=3)
    with running(settings):
        dispatch.dispatch([task_id])
        eventually(partial(_ended, dispatch, task_id, 1), what="the first run recorded")
        view = dispatch.view(task_id)
        assert (view.status, view.retry_count, view.attempt) == (Status.DELAYED, 1, 1)
        assert view.last_error == "Retry: not yet"
        assert _delay_after_last_run(dispatch, task_id) == 1500  # not the 300 ms back-off
        _run_again_when_due(dispatch, task_id)
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS)
    view = dispatch.view(task_id)
    assert (view.retry_count, view.attempt, view.result) == (1, 2, "done")
    assert _outcomes(dispatch, task_id) == ["RETRY", "SUCCESS"]
    assert procs_worker.calls[task_id] == 2


def test_snooze_counts_no_retry_and_runs_again(settings: Settings, dispatch: Dispatch) -> None:
    """max_retry 0: a snooze needs no retry left; each run is a new attempt."""
    task_id = dispatch.enqueue("t.snooze", {"s": 0.4, "times": 2}, max_retry=0)
    with running(settings):
        dispatch.dispatch([task_id])
        for run in (1, 2):
            eventually(partial(_ended, dispatch, task_id, run), what=f"snooze {run} recorded")
            view = dispatch.view(task_id)
            assert (view.status, view.retry_count, view.attempt) == (Status.DELAYED, 0, run)
            assert view.last_error == "Snooze: snoozed for 0.4 s"
            assert _delay_after_last_run(dispatch, task_id) == 400
            _run_again_when_due(dispatch, task_id)
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS)
    view = dispatch.view(task_id)
    assert (view.retry_count, view.attempt, view.result) == (0, 3, "woke")
    assert _outcomes(dispatch, task_id) == ["SNOOZED", "SNOOZED", "SUCCESS"]


def test_snoozing_past_the_bound_is_a_failure(settings: Settings, dispatch: Dispatch) -> None:
    """AX_MAX_SNOOZES=2: the third snooze is a failure (retried: one retry left), the
    fourth too (none left: FAILED). The task never loops."""
    task_id = dispatch.enqueue("t.snooze", {"s": 0.2, "times": 99}, max_retry=1)
    with running(settings):
        dispatch.dispatch([task_id])
        for run in (1, 2, 3):
            eventually(partial(_ended, dispatch, task_id, run), what=f"run {run} recorded")
            _run_again_when_due(dispatch, task_id)
        eventually(lambda: dispatch.status(task_id) is Status.FAILED)
    view = dispatch.view(task_id)
    assert (view.retry_count, view.attempt) == (1, 4)
    assert _outcomes(dispatch, task_id) == ["SNOOZED", "SNOOZED", "RETRY", "FAILED"]
    bound = "snooze bound reached (AX_MAX_SNOOZES=2), counted as a failure: Snooze: snoozed"
    assert all((a.error or "").startswith(bound) for a in view.attempts[2:])
    assert (view.last_error or "").startswith(bound)
    assert procs_worker.calls[task_id] == 4


def test_discard_fails_after_one_run_whatever_retries_are_left(
        settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.discard", {"reason": "the order is gone"}, max_retry=5)
    with running(settings):
        dispatch.dispatch([task_id])
        eventually(lambda: dispatch.status(task_id) is Status.FAILED)
    view = dispatch.view(task_id)
    assert (view.retry_count, view.attempt) == (0, 1)
    assert view.last_error == "Discard: the order is gone"
    assert _outcomes(dispatch, task_id) == ["DISCARDED"]
    assert view.attempts[0].error == "Discard: the order is gone"
    assert procs_worker.calls[task_id] == 1


def test_retry_on_retries_only_its_exceptions_with_the_types_own_backoff(
        settings: Settings, dispatch: Dispatch) -> None:
    wrong = dispatch.enqueue("t.timeouts_only", {"raise": "value"}, max_retry=3)
    slow = dispatch.enqueue("t.timeouts_only", {"raise": "timeout"}, max_retry=1)
    with running(settings):
        dispatch.dispatch([wrong, slow])
        eventually(lambda: dispatch.status(wrong) is Status.FAILED)
        eventually(partial(_ended, dispatch, slow, 1), what="the timeout recorded")
        assert dispatch.view(slow).retry_count == 1
        assert _delay_after_last_run(dispatch, slow) == 200  # Backoff(0.2, 0.2, jitter 0)
        _run_again_when_due(dispatch, slow)
        eventually(lambda: dispatch.status(slow) is Status.FAILED)
    view = dispatch.view(wrong)
    assert (view.retry_count, view.attempt) == (0, 1)
    assert view.last_error == ("ValueError: bad phone number (not retried: not one of the "
                               "processor's retry_on)")
    assert _outcomes(dispatch, wrong) == ["FAILED"]
    view = dispatch.view(slow)
    assert (view.retry_count, view.attempt) == (1, 2)
    assert view.last_error == "TimeoutError: the gateway is slow"
    assert _outcomes(dispatch, slow) == ["RETRY", "FAILED"]


class _Receiver(BaseHTTPRequestHandler):
    """Answers ``/<status>`` with that status the first time (``/503`` with Retry-After: 1),
    then 204; records when each call came."""

    calls: ClassVar[dict[str, list[float]]] = {}
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            seen = self.calls.setdefault(self.path, [])
            seen.append(time.monotonic())
            first = len(seen) == 1
        status = int(self.path.strip("/")) if first else 204
        self.send_response(status)
        if first and status == 503:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    _Receiver.calls = {}
    with serving(_Receiver) as url:
        yield url


def test_a_callbacks_status_says_what_its_failure_means(
        settings: Settings, dispatch: Dispatch, receiver: str) -> None:
    """404 → discarded after one call; 503 with Retry-After: 1 → retried no sooner than 1 s
    later; 429 (no Retry-After) → retried after the back-off."""
    ids = {status: dispatch.enqueue("hook", {"status": status}, max_retry=3,
                                    callback_url=f"{receiver}/{status}")
           for status in (404, 503, 429)}
    gone, busy, limited = ids[404], ids[503], ids[429]
    with running(settings):
        dispatch.dispatch(list(ids.values()))
        eventually(lambda: dispatch.status(gone) is Status.FAILED)
        for task_id in (busy, limited):
            eventually(partial(_ended, dispatch, task_id, 1), what="the first call recorded")
            assert dispatch.view(task_id).retry_count == 1
        assert _delay_after_last_run(dispatch, busy) == 1000
        assert 150 <= _delay_after_last_run(dispatch, limited) <= 300  # the back-off
        for task_id in (busy, limited):
            _run_again_when_due(dispatch, task_id)
        eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in (busy, limited)))
    assert {path: len(at) for path, at in _Receiver.calls.items()} == {
        "/404": 1, "/503": 2, "/429": 2}
    first, second = _Receiver.calls["/503"]
    assert second - first >= 1.0
    view = dispatch.view(gone)
    assert (view.retry_count, view.attempt) == (0, 1)
    assert view.last_error == "CallbackDiscarded: callback answered HTTP 404"
    assert _outcomes(dispatch, gone) == ["DISCARDED"]
    for task_id, status in ((busy, 503), (limited, 429)):
        view = dispatch.view(task_id)
        assert (view.retry_count, view.attempt) == (1, 2)
        assert _outcomes(dispatch, task_id) == ["RETRY", "SUCCESS"]
        assert view.attempts[0].error == f"CallbackRetry: callback answered HTTP {status}"
