"""What an outcome is stored as: every text storable (no NUL, no lone surrogate), errors
capped with a note of their size, values as JSON that reads back the same (issue 22); and
what a failure means — Retry, Snooze, Discard, a processor's retry_on and back-off, a
callback's status and Retry-After — as a table (issue 37)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from email.utils import formatdate

import pytest
from sqlalchemy.exc import DataError

from ax_kombu.config import from_env
from ax_kombu.core.backoff import Backoff, RetryPolicy
from ax_kombu.core.states import Status
from ax_kombu.exceptions import (
    CallbackFailed,
    Discard,
    ProcessorRefused,
    Retry,
    Snooze,
    ValidationError,
)
from ax_kombu.store.transitions import DISCARDED, SNOOZED, storable
from ax_kombu.worker.callbacks import (
    MAX_RETRY_AFTER_S,
    CallbackDiscarded,
    CallbackRetry,
    answer_failure,
    retry_after,
)
from ax_kombu.worker.outcomes import (
    MAX_ERROR,
    RunResult,
    decide,
    error_text,
    refused,
    refused_alone,
    stored_result,
)
from ax_kombu.worker.pools import Outcome
from ax_kombu.worker.processors import policy_of, processor, registered
from ax_kombu.worker.task import RunTask

SETTINGS = from_env({}, max_result_bytes=1000)


def task(retry_count: int = 0, max_retry: int = 0) -> RunTask:
    return RunTask(task_id=7, attempt=1, task_type="t", payload={}, trace_id="tr",
                   trigger_time=0, timeout_ms=300, priority="default",
                   retry_count=retry_count, max_retry=max_retry, processor="t",
                   callback_url=None, dispatched_at=0, node="n")


def ended(outcome: Outcome, retry_count: int = 0, max_retry: int = 0) -> RunResult:
    return RunResult(task(retry_count, max_retry), outcome, 5000)


def assert_storable(text: str) -> None:
    assert "\x00" not in text
    text.encode()  # no lone surrogate: UTF-8 encodes it


@pytest.mark.parametrize(("raw", "stored"), [
    ("plain", "plain"),
    ("bad\x00byte", "bad\\x00byte"),
    ("\x00\x00", "\\x00\\x00"),
    ("file \udc80.txt", "file \\udc80.txt"),
    ("ü and \u2603", "ü and \u2603"),
])
def test_storable_escapes_nul_and_lone_surrogates_as_repr_shows_them(raw: str,
                                                                     stored: str) -> None:
    assert storable(raw) == stored
    assert_storable(storable(raw))


def test_an_error_with_a_nul_fails_with_a_readable_reason() -> None:
    finish = decide(ended(Outcome(False, error=ValueError("bad\x00byte"))), SETTINGS,
                    random.Random(1))
    assert (finish.status, finish.error) == (Status.FAILED, "ValueError: bad\\x00byte")


def test_a_huge_error_is_capped_with_a_note_of_its_size_and_quickly() -> None:
    message = "x" * 2_000_000  # all letters: the worst case of the URL search in redact_url
    started = time.monotonic()
    finish = decide(ended(Outcome(False, error=RuntimeError(message))), SETTINGS,
                    random.Random(1))
    took = time.monotonic() - started
    assert finish.error is not None and len(finish.error) == MAX_ERROR
    assert finish.error.startswith("RuntimeError: xxx")
    assert finish.error.endswith(f" … [truncated; {len('RuntimeError: ') + 2_000_000} "
                                 "characters in all]")
    assert took < 1.0, f"describing a 2 MB error took {took:.2f} s"


def test_a_short_error_is_kept_whole_and_redacted() -> None:
    text = error_text("ConnectionError: redis://:secret@h:6379/0 refused")
    assert text == "ConnectionError: redis://:***@h:6379/0 refused"


def test_escaping_that_passes_the_cap_is_cut_to_it() -> None:
    text = error_text("\x00" * MAX_ERROR)
    assert len(text) == MAX_ERROR and text.startswith("\\x00\\x00")
    assert text.endswith(f"[truncated; {MAX_ERROR} characters in all]")


def test_an_exception_whose_str_raises_is_named() -> None:
    class Odd(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    finish = decide(ended(Outcome(False, error=Odd())), SETTINGS, random.Random(1))
    assert finish.error == "Odd: (its message could not be read)"


@pytest.mark.parametrize("value", ["bad\x00byte", {"k\x00": ["\x00"]}, "file \udc80.txt",
                                   ["ü", "\u2603"]])
def test_a_value_with_nul_or_lone_surrogate_is_stored_as_json_that_reads_back_the_same(
        value: object) -> None:
    finish = decide(ended(Outcome(True, value=value)), SETTINGS, random.Random(1))
    assert finish.status is Status.SUCCESS and finish.result is not None
    assert_storable(finish.result)
    assert json.loads(finish.result) == value


def test_a_value_over_the_limit_or_not_json_is_not_stored_and_the_note_says_why() -> None:
    assert stored_result("x" * 2000, 1000) == (
        None, "result not stored: 2002 bytes, over AX_MAX_RESULT_BYTES (1000)")
    stored, note = stored_result({1, 2}, 1000)
    assert stored is None and note is not None and "not JSON (TypeError" in note

    stored, note = stored_result([float("nan")], 1000)
    assert stored is None and note is not None and "not JSON (ValueError" in note


def test_a_refused_outcome_becomes_failed_with_an_ascii_reason() -> None:
    result = ended(Outcome(False, error=ValueError("é\x00")), retry_count=0, max_retry=3)
    delayed = decide(result, SETTINGS, random.Random(1))
    assert delayed.status is Status.DELAYED and delayed.at_ms > result.ended_ms
    failed = refused(result.ended_ms, delayed, DataError("UPDATE …", {}, Exception("bad \x00 value")))
    assert (failed.status, failed.at_ms, failed.result) == (Status.FAILED, 5000, None)
    assert failed.error is not None
    assert failed.error.isascii() and "\x00" not in failed.error
    assert failed.error.startswith("outcome refused by the store (DataError: ")
    assert failed.error.endswith("the run ended DELAYED: ValueError: \\xe9\\x00")


def test_a_refused_batch_is_halved_until_each_refused_item_is_alone() -> None:
    written: list[int] = []
    calls = 0

    def write(batch: Sequence[int]) -> Exception | None:
        nonlocal calls
        calls += 1
        bad = [i for i in batch if i in (3, 6)]
        if bad:
            return ValueError(f"refused {bad}")
        written.extend(batch)
        return None

    alone = refused_alone(list(range(8)), write)
    assert [(i, str(e)) for i, e in alone] == [(3, "refused [3]"), (6, "refused [6]")]
    assert sorted(written) == [0, 1, 2, 4, 5, 7]
    assert calls <= 2 * 2 * 3 + 1  # about 2 log2(n) writes per refused item, and the first
    assert refused_alone([1, 2], write) == [] and written[-2:] == [1, 2]


# --- what a failure means: decide as a table (issue 37) --------------------------------------

RULES = from_env({}, retry_backoff_base_ms=1000, retry_backoff_max_ms=60_000,
                 retry_backoff_jitter=0.5, max_snoozes=3)
END = 5000
ONLY_TIMEOUTS = RetryPolicy(retry_on=(TimeoutError,))
OWN_BACKOFF = RetryPolicy(backoff=Backoff(base=10, cap=15, jitter=0))
PAST_BOUND = ("snooze bound reached (AX_MAX_SNOOZES=3), counted as a failure: "
              "Snooze: snoozed for 60 s")


class Top:
    """An rng at 0: every back-off is its ceiling (jitter takes nothing off)."""

    def random(self) -> float:
        return 0.0


def run(outcome: Outcome, retry_count: int = 0, max_retry: int = 3,
        attempt: int | None = None) -> RunResult:
    message = dataclasses.replace(task(retry_count, max_retry),
                                  attempt=retry_count + 1 if attempt is None else attempt)
    return RunResult(message, outcome, END)


def raised(error: BaseException) -> Outcome:
    return Outcome(False, error=error)


class _LibraryTimeout(TimeoutError):
    """A TimeoutError subclass, as a library raises one."""


def socket_timeout(message: str) -> TimeoutError:
    return _LibraryTimeout(message)


# (case, run, policy) → (status, delay after the run's end or None if final, kind, error)
DECISIONS = [
    ("ok", run(Outcome(True)), None, (Status.SUCCESS, None, None, None)),
    ("error, retries left", run(raised(ValueError("x")), 1), None,
     (Status.DELAYED, 2000, None, "ValueError: x")),
    ("error, no retries left", run(raised(ValueError("x")), 3, 3), None,
     (Status.FAILED, None, None, "ValueError: x")),
    ("Retry(delay=30)", run(raised(Retry(delay=30))), None,
     (Status.DELAYED, 30_000, None, "Retry: retry in 30 s")),
    ("Retry(timedelta)", run(raised(Retry(timedelta(milliseconds=1500), "busy"))), None,
     (Status.DELAYED, 1500, None, "Retry: busy")),
    ("Retry(), the back-off", run(raised(Retry()), 2), None,
     (Status.DELAYED, 4000, None, "Retry: retry requested")),
    ("Retry(delay=30), no retries left", run(raised(Retry(delay=30)), 3, 3), None,
     (Status.FAILED, None, None, "Retry: retry in 30 s")),
    ("Snooze(60), no retry counted, none needed", run(raised(Snooze(60)), 0, 0), None,
     (Status.DELAYED, 60_000, SNOOZED, "Snooze: snoozed for 60 s")),
    ("Snooze within the bound (2 snoozes before)", run(raised(Snooze(1)), 1, 3, attempt=4),
     None, (Status.DELAYED, 1000, SNOOZED, "Snooze: snoozed for 1 s")),
    ("Snooze past the bound, retries left", run(raised(Snooze(60)), 1, 3, attempt=5), None,
     (Status.DELAYED, 2000, None, PAST_BOUND)),
    ("Snooze past the bound, no retries left", run(raised(Snooze(60)), 0, 0, attempt=4), None,
     (Status.FAILED, None, None, PAST_BOUND)),
    ("Discard, retries left", run(raised(Discard("bad payload"))), None,
     (Status.FAILED, None, DISCARDED, "Discard: bad payload")),
    ("ProcessorRefused, retries left", run(raised(ProcessorRefused("no"))), None,
     (Status.FAILED, None, None, "ProcessorRefused: no")),
    ("timeout, retries left", run(Outcome(False, timed_out=True)), None,
     (Status.DELAYED, 1000, None, "timed out after 300 ms")),
    ("abandoned, no retries left", run(Outcome(False, abandoned="shutdown"), 3, 3), None,
     (Status.FAILED, None, None, "abandoned: shutdown")),
    ("retry_on matches", run(raised(TimeoutError("slow"))), ONLY_TIMEOUTS,
     (Status.DELAYED, 1000, None, "TimeoutError: slow")),
    ("retry_on matches a subclass", run(raised(socket_timeout("t"))), ONLY_TIMEOUTS,
     (Status.DELAYED, 1000, None, "_LibraryTimeout: t")),
    ("retry_on does not match", run(raised(ValueError("x"))), ONLY_TIMEOUTS,
     (Status.FAILED, None, None,
      "ValueError: x (not retried: not one of the processor's retry_on)")),
    ("retry_on and Retry(delay=5)", run(raised(Retry(delay=5))), ONLY_TIMEOUTS,
     (Status.DELAYED, 5000, None, "Retry: retry in 5 s")),
    ("retry_on and Snooze(2)", run(raised(Snooze(2))), ONLY_TIMEOUTS,
     (Status.DELAYED, 2000, SNOOZED, "Snooze: snoozed for 2 s")),
    ("retry_on and Discard", run(raised(Discard())), ONLY_TIMEOUTS,
     (Status.FAILED, None, DISCARDED, "Discard: discarded")),
    ("retry_on and a timeout", run(Outcome(False, timed_out=True)), ONLY_TIMEOUTS,
     (Status.DELAYED, 1000, None, "timed out after 300 ms")),
    ("retry_on=() retries nothing", run(raised(TimeoutError("t"))), RetryPolicy(retry_on=()),
     (Status.FAILED, None, None,
      "TimeoutError: t (not retried: not one of the processor's retry_on)")),
    ("own Backoff, retry 0", run(raised(ValueError("x")), 0), OWN_BACKOFF,
     (Status.DELAYED, 10_000, None, "ValueError: x")),
    ("own Backoff, capped", run(raised(ValueError("x")), 1), OWN_BACKOFF,
     (Status.DELAYED, 15_000, None, "ValueError: x")),
    ("own Backoff for Retry()", run(raised(Retry()), 1), OWN_BACKOFF,
     (Status.DELAYED, 15_000, None, "Retry: retry requested")),
    ("callback 404", run(raised(answer_failure(404, None))), None,
     (Status.FAILED, None, DISCARDED, "CallbackDiscarded: callback answered HTTP 404")),
    ("callback 503, Retry-After 3", run(raised(answer_failure(503, 3.0))), None,
     (Status.DELAYED, 3000, None, "CallbackRetry: callback answered HTTP 503")),
    ("callback 429, no Retry-After", run(raised(answer_failure(429, None)), 1), None,
     (Status.DELAYED, 2000, None, "CallbackRetry: callback answered HTTP 429")),
]


@pytest.mark.parametrize(("result", "policy", "expected"),
                         [pytest.param(r, p, e, id=name) for name, r, p, e in DECISIONS])
def test_what_a_failure_means(result: RunResult, policy: RetryPolicy | None,
                              expected: tuple[Status, int | None, str | None, str | None]
                              ) -> None:
    status, delay, kind, error = expected
    finish = decide(result, RULES, Top(), policy)
    assert (finish.status, finish.kind, finish.error) == (status, kind, error)
    assert finish.at_ms == END + (delay or 0)
    assert (finish.task_id, finish.attempt) == (result.task.task_id, result.task.attempt)


def test_the_default_bound_lets_a_task_snooze_a_hundred_times() -> None:
    assert SETTINGS.max_snoozes == 100
    assert decide(run(raised(Snooze(1)), 0, 0, attempt=100), SETTINGS, Top()).kind == SNOOZED
    assert decide(run(raised(Snooze(1)), 0, 0, attempt=101), SETTINGS, Top()).kind is None


@pytest.mark.parametrize("make", [lambda: Retry(delay=-1), lambda: Snooze(float("nan")),
                                  lambda: Snooze("60"),  # type: ignore[arg-type]
                                  lambda: Retry(delay=True),
                                  lambda: Snooze(timedelta(days=4000))])
def test_a_bad_delay_is_refused(make: Callable[[], Exception]) -> None:
    with pytest.raises(ValidationError):
        make()


def test_directives_pickle_with_their_delay_and_reason() -> None:
    for error in (Retry(2.5, "busy"), Retry(), Snooze(60), Discard("gone"),
                  answer_failure(503, 1.0), answer_failure(404, None)):
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), str(again), getattr(again, "delay", None)) == (
            type(error), str(error), getattr(error, "delay", None))


# --- a callback's answer --------------------------------------------------------------------

NOW = 1_700_000_000.0


@pytest.mark.parametrize(("header", "seconds"), [
    (None, None),
    ("120", 120.0),
    (" 7 ", 7.0),
    ("0", 0.0),
    ("99999", MAX_RETRY_AFTER_S),
    (formatdate(NOW + 30, usegmt=True), 30.0),
    (formatdate(NOW + 30), 30.0),  # "-0000": still GMT
    (formatdate(NOW - 600, usegmt=True), 0.0),  # already past
    (formatdate(NOW + 86_400, usegmt=True), MAX_RETRY_AFTER_S),
    ("soon", None),
    ("-5", None),
    ("1.5", None),
    ("", None),
])
def test_retry_after_is_seconds_or_an_http_date_capped(header: str | None,
                                                       seconds: float | None) -> None:
    assert retry_after(header, NOW) == seconds


@pytest.mark.parametrize(("status", "kind"), [
    (400, CallbackDiscarded), (401, CallbackDiscarded), (404, CallbackDiscarded),
    (410, CallbackDiscarded), (422, CallbackDiscarded), (499, CallbackDiscarded),
    (408, CallbackRetry), (429, CallbackRetry), (500, CallbackRetry), (503, CallbackRetry),
    (599, CallbackRetry), (302, CallbackFailed), (101, CallbackFailed),
])
def test_a_callback_status_says_what_its_failure_means(status: int, kind: type) -> None:
    failure = answer_failure(status, 12.0)
    assert type(failure) is kind and isinstance(failure, CallbackFailed)
    assert str(failure) == f"callback answered HTTP {status}"
    if kind is CallbackRetry:
        assert isinstance(failure, Retry) and failure.delay == 12.0


# --- a processor's policy, checked when it registers -----------------------------------------


def test_a_policy_is_registered_with_its_processor_and_replaced_with_it() -> None:
    policy = RetryPolicy((TimeoutError,), Backoff(base=1, cap=600, jitter=0.5))

    @processor("unit.outcomes.sms", retry_on=(TimeoutError,),
               backoff=Backoff(base=1, cap=600, jitter=0.5))
    def send(payload: object, ctx: object) -> None: ...

    assert registered("unit.outcomes.sms") is send and policy_of("unit.outcomes.sms") == policy
    processor("unit.outcomes.sms")(send)
    assert policy_of("unit.outcomes.sms") is None
    assert policy_of(None) is None and policy_of("unit.outcomes.none") is None


@pytest.mark.parametrize("options", [
    {"retry_on": TimeoutError}, {"retry_on": [TimeoutError]}, {"retry_on": (TimeoutError, 3)},
    {"retry_on": (int,)}, {"retry_on": (TimeoutError("x"),)}, {"backoff": 5},
    {"backoff": {"base": 1}},
])
def test_a_bad_policy_is_refused_and_registers_nothing(options: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        processor("unit.outcomes.bad", **options)(lambda payload, ctx: None)  # type: ignore[arg-type]
    assert registered("unit.outcomes.bad") is None and policy_of("unit.outcomes.bad") is None


def test_the_core_decision_names_the_attempt_kinds_the_store_writes() -> None:
    from ax_kombu.core import outcomes as core

    assert (core.SNOOZED, core.DISCARDED) == (SNOOZED, DISCARDED)
