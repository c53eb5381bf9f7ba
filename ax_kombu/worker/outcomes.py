"""What a run's outcome is stored as: the state change it leads to, and texts the store takes.

Pure (no I/O): :func:`decide` turns one :class:`RunResult` (and its processor's
:class:`~ax_kombu.core.backoff.RetryPolicy`, if it registered one) into a
:class:`~ax_kombu.store.transitions.Finish`. What a failure means, first rule that applies:

* a timeout, or a run abandoned at shutdown → a retry, if any is left (ax's doing, not
  the processor's: ``retry_on`` does not apply);
* :class:`~ax_kombu.exceptions.ProcessorRefused` → FAILED (retrying cannot help);
* :class:`~ax_kombu.exceptions.Discard` → FAILED at once, attempt kind DISCARDED;
* :class:`~ax_kombu.exceptions.Snooze` → DELAYED at the run's end + its delay, no retry
  counted, attempt kind SNOOZED, while the task's attempts that were not retries
  (``attempt − 1 − retry_count``: snoozes, and dispatches again after a lost message)
  are fewer than ``AX_MAX_SNOOZES``; past that, a failure (next rules);
* :class:`~ax_kombu.exceptions.Retry` → a retry after its delay (none given: the back-off);
* any other exception that is not one of the policy's ``retry_on`` → FAILED at once;
* otherwise → a retry after the back-off (the policy's, else ``AX_RETRY_BACKOFF_*``).

A retry is DELAYED with ``retry_count + 1`` if ``retry_count < max_retry``, else FAILED.
Everything decide puts into a text column has passed through here first:

* an error's text (``last_error``, the attempt history) is redacted
  (:func:`~ax_kombu.config.redact_url`: a callback's URL may carry a token), made
  storable and capped at :data:`MAX_ERROR` characters; a longer text ends with a note
  of its full length;
* a return value is stored as JSON up to ``max_result_bytes``; one that is not JSON
  or is larger is not stored (the run is still a success, the attempt history has
  the reason).

*Storable* (:func:`~ax_kombu.store.transitions.storable`) means both stores accept
it: PostgreSQL refuses a NUL in a TEXT value, and both drivers refuse a lone surrogate
(a str decoded with ``surrogateescape``) when they encode UTF-8. Nothing a processor
raises or returns reaches the store as anything else, so no outcome can make the result
writer's batch fail for its text (and ``finish_many`` guards the same way, for every
caller).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.config import Settings, redact_url
from ax_kombu.core.backoff import RetryPolicy, Uniform, backoff_ms
from ax_kombu.core.states import Status
from ax_kombu.exceptions import Discard, ProcessorRefused, Retry, Snooze
from ax_kombu.store.transitions import DISCARDED, SNOOZED, Finish, storable
from ax_kombu.worker.pools import Outcome

#: longest error text stored (``last_error``, an attempt's ``error``), in characters
MAX_ERROR = 2000
#: how much of an error's text is searched for URLs to redact. The search is not linear
#: in the text's length: a few MB of letters would hold the result writer for an hour.
_REDACT_WINDOW = MAX_ERROR + 1000


class RunResult(NamedTuple):
    """One outcome, with the task it belongs to and when it ended (DB clock)."""

    task: TaskMessage
    outcome: Outcome
    ended_ms: int


def error_text(text: str, limit: int = MAX_ERROR) -> str:
    """An error's text as stored: redacted, storable, at most ``limit`` characters.

    A text cut to fit ends with ``… [truncated; N characters in all]``, N being the
    length of the text given.
    """
    size = len(text)
    stored = storable(redact_url(text[:_REDACT_WINDOW]))
    if size <= limit and len(stored) <= limit:
        return stored
    note = f" … [truncated; {size} characters in all]"
    return stored[:limit - len(note)] + note


def _exception_text(error: BaseException) -> str:
    """``Type: message``; an exception whose ``str()`` itself raises is named only."""
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - a processor's exception may be anything
        message = "(its message could not be read)"
    return f"{type(error).__name__}: {message}"


def describe(result: RunResult) -> str:
    """The text stored in ``last_error`` for a run that did not succeed."""
    outcome, task = result.outcome, result.task
    if outcome.timed_out:
        text = f"timed out after {task.timeout_ms} ms"
    elif outcome.abandoned is not None:
        text = f"abandoned: {outcome.abandoned}"
    elif outcome.error is not None:
        text = _exception_text(outcome.error)
    else:
        text = "failed"
    return error_text(text)


def stored_result(value: Any, limit: int) -> tuple[str | None, str | None]:
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
        return None, error_text(f"result not stored: not JSON ({_exception_text(exc)})")
    if len(data) > limit:
        return None, f"result not stored: {len(data)} bytes, over AX_MAX_RESULT_BYTES ({limit})"
    return text, None


def decide(result: RunResult, settings: Settings, rng: Uniform,
           policy: RetryPolicy | None = None) -> Finish:
    """The state change a run's outcome leads to: the rules in this module's docstring.

    Args:
        policy: the task's processor's own (None: retry any exception, with
            ``AX_RETRY_BACKOFF_*``).
    """
    task, outcome = result.task, result.outcome
    if outcome.ok:
        stored, _ = stored_result(outcome.value, settings.max_result_bytes)
        return Finish(task.task_id, task.attempt, Status.SUCCESS, result.ended_ms,
                      result=stored, started_at=task.started_at)
    error, raised = describe(result), outcome.error
    retry = _Retry(result, settings, rng, policy)
    if outcome.timed_out or outcome.abandoned is not None or raised is None:
        return retry(error)
    if isinstance(raised, ProcessorRefused):
        return _end(result, Status.FAILED, result.ended_ms, error)
    if isinstance(raised, Discard):
        return _end(result, Status.FAILED, result.ended_ms, error, DISCARDED)
    if isinstance(raised, Snooze):
        if task.attempt - 1 - task.retry_count < settings.max_snoozes:
            return _end(result, Status.DELAYED, result.ended_ms + _ms(raised.delay), error,
                        SNOOZED)
        return retry(error_text(f"snooze bound reached (AX_MAX_SNOOZES="
                                f"{settings.max_snoozes}), counted as a failure: {error}"))
    if isinstance(raised, Retry):
        return retry(error, None if raised.delay is None else _ms(raised.delay))
    if policy is not None and policy.retry_on is not None \
            and not isinstance(raised, policy.retry_on):
        return _end(result, Status.FAILED, result.ended_ms, error_text(
            f"{error} (not retried: not one of the processor's retry_on)"))
    return retry(error)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _end(result: RunResult, status: Status, at_ms: int, error: str,
         kind: str | None = None) -> Finish:
    task = result.task
    return Finish(task.task_id, task.attempt, status, at_ms, error,
                  started_at=task.started_at, kind=kind)


class _Retry(NamedTuple):
    """A run's retry: DELAYED after a delay (None: the back-off) if one is left, else FAILED."""

    result: RunResult
    settings: Settings
    rng: Uniform
    policy: RetryPolicy | None

    def __call__(self, error: str, delay_ms: int | None = None) -> Finish:
        result = self.result
        if result.task.retry_count >= result.task.max_retry:
            return _end(result, Status.FAILED, result.ended_ms, error)
        if delay_ms is None:
            delay_ms = self._backoff_ms()
        return _end(result, Status.DELAYED, result.ended_ms + delay_ms, error)

    def _backoff_ms(self) -> int:
        retry_count, settings = self.result.task.retry_count, self.settings
        if self.policy is not None and self.policy.backoff is not None:
            return self.policy.backoff.delay_ms(retry_count, self.rng)
        return backoff_ms(retry_count, settings.retry_backoff_base_ms,
                          settings.retry_backoff_max_ms, self.rng, settings.retry_backoff_jitter)


def refused(ended_ms: int, finish: Finish, error: BaseException) -> Finish:
    """The end recorded for a run whose outcome the store refused (for its data, not for a
    lost connection): FAILED when the run ended, ``last_error`` naming the refusal and the
    end it replaces, in plain ASCII; no result."""
    text = f"outcome refused by the store ({_exception_text(error)}); the run ended {finish.status}"
    if finish.error:
        text += f": {finish.error}"
    reason = error_text(text).encode("ascii", "backslashreplace").decode()[:MAX_ERROR]
    return Finish(finish.task_id, finish.attempt, Status.FAILED, ended_ms, reason,
                  started_at=finish.started_at)


T = TypeVar("T")


def refused_alone(batch: Sequence[T], write: Callable[[Sequence[T]], Exception | None]
                  ) -> list[tuple[T, Exception]]:
    """Write ``batch`` with ``write`` (None: written, else the error with which the store
    refused the batch's data); a refused batch is halved until each refused item is alone
    (about 2 log2(n) writes for one among n), the others written as they are. Returns the
    items refused alone, each with its error, for the caller to record otherwise."""
    error = write(batch)
    if error is None:
        return []
    if len(batch) == 1:
        return [(batch[0], error)]
    half = len(batch) // 2
    return refused_alone(batch[:half], write) + refused_alone(batch[half:], write)
