"""A worker run's outcome as the store takes it: :func:`decide` builds the
:class:`~ax_kombu.store.transitions.Finish` the result writer writes.

The rules are :func:`ax_kombu.core.outcomes.decide`'s (one decision for ax and Celery runs);
this module gives them the worker's run record (:class:`RunResult`) and ax's way to make a
text storable (:func:`ax_kombu.store.ends.clean_text`: redacted, no NUL, no lone
surrogate, so no outcome can make the result writer's batch fail for its text).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ax_kombu.config import Settings
from ax_kombu.core import outcomes as core
from ax_kombu.core.backoff import RetryPolicy, Uniform
from ax_kombu.core.outcomes import MAX_ERROR, Outcome
from ax_kombu.store.ends import clean_text, refused, refused_alone
from ax_kombu.store.transitions import Finish
from ax_kombu.worker.task import Ended

__all__ = ["MAX_ERROR", "RunResult", "decide", "describe", "error_text", "refused",
           "refused_alone", "stored_result"]


class RunResult(NamedTuple):
    """One outcome, with the task it belongs to and when it ended (DB clock)."""

    task: Ended
    outcome: Outcome
    ended_ms: int


def error_text(text: str, limit: int = MAX_ERROR) -> str:
    """An error's text as stored: redacted, storable, at most ``limit`` characters
    (:func:`ax_kombu.core.outcomes.error_text`)."""
    return core.error_text(text, clean_text, limit)


def describe(result: RunResult) -> str:
    """The text stored in ``last_error`` for a run that did not succeed."""
    return core.describe(result.task, result.outcome, clean_text)


def stored_result(value: Any, limit: int) -> tuple[str | None, str | None]:
    """A return value as stored: ``(json_text, note)``
    (:func:`ax_kombu.core.outcomes.stored_result`)."""
    return core.stored_result(value, limit, clean_text)


def decide(result: RunResult, settings: Settings, rng: Uniform,
           policy: RetryPolicy | None = None) -> Finish:
    """The state change a run's outcome leads to (:func:`ax_kombu.core.outcomes.decide`).

    Args:
        policy: the task's processor's own (None: retry any exception, with
            ``AX_RETRY_BACKOFF_*``).
    """
    task = result.task
    end = core.decide(task, result.outcome, result.ended_ms, settings, rng, clean_text, policy)
    return Finish(task.task_id, task.attempt, end.status, end.at_ms, end.error, end.result,
                  task.started_at, end.kind)
