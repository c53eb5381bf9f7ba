"""What an outcome is stored as: every text storable (no NUL, no lone surrogate), errors
capped with a note of their size, values as JSON that reads back the same (issue 22)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence

import pytest
from sqlalchemy.exc import DataError

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.config import from_env
from ax_kombu.core.states import Status
from ax_kombu.store.transitions import storable
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

SETTINGS = from_env({}, max_result_bytes=1000)


def task(retry_count: int = 0, max_retry: int = 0) -> TaskMessage:
    return TaskMessage(task_id=7, attempt=1, task_type="t", payload={}, trace_id="tr",
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
