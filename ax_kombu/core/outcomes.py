"""What a run's outcome leads to: one decision for ax runs and Celery runs alike.

Pure (no I/O, no clock: the run's end time is given): :func:`decide` turns one run's
:class:`Outcome` (and its processor's :class:`~ax_kombu.core.backoff.RetryPolicy`, if it
registered one) into a :class:`Decision`: the task's next status, when, and the texts
stored with it. What a failure means, first rule that applies:

* a timeout, or a run abandoned at shutdown → a retry, if any is left (ax's doing, not
  the processor's: ``retry_on`` does not apply);
* :class:`~ax_kombu.exceptions.ProcessorRefused` → FAILED (retrying cannot help);
* :class:`~ax_kombu.exceptions.Discard` → FAILED at once, attempt kind :data:`DISCARDED`;
* :class:`~ax_kombu.exceptions.Snooze` → DELAYED at the run's end + its delay, no retry
  counted, attempt kind :data:`SNOOZED`, while the task's attempts that were not retries
  (``attempt − 1 − retry_count``: snoozes, and dispatches again after a lost message)
  are fewer than the rules' ``max_snoozes``; past that, a failure (next rules);
* :class:`~ax_kombu.exceptions.Retry` → a retry after its delay (none given: the back-off);
* any other exception that is not one of the policy's ``retry_on`` → FAILED at once;
* otherwise → a retry after the back-off (the policy's, else the rules' ``retry_backoff_*``).

A retry is DELAYED (the store adds one to ``retry_count``) if ``retry_count < max_retry``,
else FAILED. Every text the decision carries has passed through :func:`error_text` or
:func:`stored_result` with the caller's ``clean`` function (the store's redaction and
storable form: this layer imports neither), so the caller decides what "storable" means
and this module only where it applies.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from ax_kombu.core.backoff import RetryPolicy, Uniform, backoff_ms
from ax_kombu.core.errors import Discard, ProcessorRefused, Retry, Snooze
from ax_kombu.core.states import Status

#: longest error text stored (``last_error``, an attempt's ``error``), in characters
MAX_ERROR = 2000
#: how much of an error's text is cleaned (searched for URLs to redact). The search is not
#: linear in the text's length: a few MB of letters would stall the end writer for an hour.
_CLEAN_WINDOW = MAX_ERROR + 1000
#: the attempt kind of a run snoozed (DELAYED without a retry counted)
SNOOZED = "SNOOZED"
#: the attempt kind of a run its processor discarded (FAILED at once)
DISCARDED = "DISCARDED"

#: a text made fit for the store (e.g. redacted, no NUL, no lone surrogate)
Clean = Callable[[str], str]


class Outcome(NamedTuple):
    """How one run ended, as its executor reports it. A NamedTuple: one is made per run,
    and a tuple costs a fraction of a frozen dataclass to build."""

    ok: bool
    value: Any = None
    error: BaseException | None = None
    #: the run overran its timeout (it may still be running)
    timed_out: bool = False
    #: why the run was given up on without waiting for it (e.g. shutdown)
    abandoned: str | None = None
    #: seconds from start to this report
    duration_s: float = 0.0


class RunFacts(Protocol):
    """What the decision reads of a run's task (a worker's message, a Celery run's record)."""

    @property
    def attempt(self) -> int: ...
    @property
    def retry_count(self) -> int: ...
    @property
    def max_retry(self) -> int: ...
    @property
    def timeout_ms(self) -> int: ...


class Rules(Protocol):
    """The settings the decision reads (:class:`ax_kombu.config.Settings` has them)."""

    @property
    def max_result_bytes(self) -> int: ...
    @property
    def max_snoozes(self) -> int: ...
    @property
    def retry_backoff_base_ms(self) -> int: ...
    @property
    def retry_backoff_max_ms(self) -> int: ...
    @property
    def retry_backoff_jitter(self) -> float: ...


class Decision(NamedTuple):
    """A run's end: its task's next status and the columns stored with it."""

    status: Status
    #: ``finished_at`` for SUCCESS and FAILED, the new ``trigger_time`` for DELAYED
    at_ms: int
    error: str | None = None
    #: SUCCESS: the return value as JSON text (None: none, or not stored)
    result: str | None = None
    #: :data:`SNOOZED`, :data:`DISCARDED`, or None when the status says how it ended
    kind: str | None = None


def error_text(text: str, clean: Clean, limit: int = MAX_ERROR) -> str:
    """An error's text as stored: cleaned, at most ``limit`` characters.

    A text cut to fit ends with ``… [truncated; N characters in all]``, N being the
    length of the text given.
    """
    size = len(text)
    stored = clean(text[:_CLEAN_WINDOW])
    if size <= limit and len(stored) <= limit:
        return stored
    note = f" … [truncated; {size} characters in all]"
    return stored[:limit - len(note)] + note


def exception_text(error: BaseException) -> str:
    """``Type: message``; an exception whose ``str()`` itself raises is named only."""
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - a processor's exception may be anything
        message = "(its message could not be read)"
    return f"{type(error).__name__}: {message}"


def describe(task: RunFacts, outcome: Outcome, clean: Clean) -> str:
    """The text stored in ``last_error`` for a run that did not succeed."""
    if outcome.timed_out:
        text = f"timed out after {task.timeout_ms} ms"
    elif outcome.abandoned is not None:
        text = f"abandoned: {outcome.abandoned}"
    elif outcome.error is not None:
        text = exception_text(outcome.error)
    else:
        text = "failed"
    return error_text(text, clean)


def stored_result(value: Any, limit: int, clean: Clean) -> tuple[str | None, str | None]:
    """A processor's return value as stored: ``(json_text, note)``. None is stored as
    nothing; a value that is not JSON, or over ``limit`` bytes, is not stored and the note
    says why (the run is still a success). A NUL in the value is stored as JSON's
    ``\\u0000`` and a lone surrogate as its ``\\u`` escape: the same value is read back."""
    if value is None:
        return None, None
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        try:
            data = text.encode()
        except UnicodeEncodeError:  # a lone surrogate: ASCII JSON escapes it
            text = json.dumps(value, allow_nan=False, separators=(",", ":"))
            data = text.encode()
    except Exception as exc:  # noqa: BLE001 - a return value may be anything
        return None, error_text(f"result not stored: not JSON ({exception_text(exc)})", clean)
    if len(data) > limit:
        return None, f"result not stored: {len(data)} bytes, over AX_MAX_RESULT_BYTES ({limit})"
    return text, None


def decide(task: RunFacts, outcome: Outcome, ended_ms: int, rules: Rules, rng: Uniform,
           clean: Clean, policy: RetryPolicy | None = None) -> Decision:
    """The end a run's outcome leads to: the rules in this module's docstring.

    Args:
        ended_ms: when the run ended (DB clock).
        clean: makes a text storable (see the module docstring).
        policy: the task's processor's own (None: retry any exception, with the rules'
            ``retry_backoff_*``).
    """
    if outcome.ok:
        return Decision(Status.SUCCESS, ended_ms,
                        result=stored_result(outcome.value, rules.max_result_bytes, clean)[0])
    error, raised = describe(task, outcome, clean), outcome.error
    if outcome.timed_out or outcome.abandoned is not None or raised is None:
        return _retry(task, ended_ms, rules, rng, policy, error)
    if isinstance(raised, ProcessorRefused):
        return Decision(Status.FAILED, ended_ms, error)
    if isinstance(raised, Discard):
        return Decision(Status.FAILED, ended_ms, error, kind=DISCARDED)
    if isinstance(raised, Snooze):
        if task.attempt - 1 - task.retry_count < rules.max_snoozes:
            return Decision(Status.DELAYED, ended_ms + _ms(raised.delay), error, kind=SNOOZED)
        error = error_text(f"snooze bound reached (AX_MAX_SNOOZES={rules.max_snoozes}), "
                           f"counted as a failure: {error}", clean)
        return _retry(task, ended_ms, rules, rng, policy, error)
    if isinstance(raised, Retry):
        delay = None if raised.delay is None else _ms(raised.delay)
        return _retry(task, ended_ms, rules, rng, policy, error, delay)
    if policy is not None and policy.retry_on is not None \
            and not isinstance(raised, policy.retry_on):
        return Decision(Status.FAILED, ended_ms, error_text(
            f"{error} (not retried: not one of the processor's retry_on)", clean))
    return _retry(task, ended_ms, rules, rng, policy, error)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _retry(task: RunFacts, ended_ms: int, rules: Rules, rng: Uniform,
           policy: RetryPolicy | None, error: str, delay_ms: int | None = None) -> Decision:
    """A retry: DELAYED after ``delay_ms`` (None: the back-off) if one is left, else FAILED."""
    if task.retry_count >= task.max_retry:
        return Decision(Status.FAILED, ended_ms, error)
    if delay_ms is None:
        if policy is not None and policy.backoff is not None:
            delay_ms = policy.backoff.delay_ms(task.retry_count, rng)
        else:
            delay_ms = backoff_ms(task.retry_count, rules.retry_backoff_base_ms,
                                  rules.retry_backoff_max_ms, rng, rules.retry_backoff_jitter)
    return Decision(Status.DELAYED, ended_ms + delay_ms, error)
