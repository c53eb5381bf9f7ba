"""Every error ax raises on purpose derives from :class:`AxError` (imported by users from
:mod:`ax_kombu.exceptions`).

The CLI turns an ``AxError`` into a one-line message and a non-zero exit code;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import math
from datetime import timedelta


class AxError(Exception):
    """Root of every error ax raises on purpose."""

    exit_code = 1


class ConfigurationError(AxError):
    """A setting is missing, malformed or contradicts another one."""

    exit_code = 2


class ValidationError(AxError, ValueError):
    """Input to enqueue (or another public call) is invalid; nothing was written."""

    exit_code = 2


class TaskNotFound(AxError, LookupError):
    """No task has the given id."""

    exit_code = 3


class JobNotFound(AxError, LookupError):
    """No recurring job has the given name."""

    exit_code = 3


class WaitTimeout(AxError, TimeoutError):
    """``ax.wait`` gave up: the task had not finished within the timeout."""

    exit_code = 1


class IllegalTransition(AxError):
    """A state change that the state machine does not allow was requested."""

    exit_code = 4


class TooLateToMove(IllegalTransition):
    """A task asked to move has been claimed, is staged for its start, or is running."""

    exit_code = 4


class StoreError(AxError):
    """The task store could not be reached or refused an operation."""

    exit_code = 5


class IdExhausted(AxError):
    """No snowflake node id could be reserved (all 1024 are taken)."""

    exit_code = 5


class ProcessorNotFound(AxError, LookupError):
    """No processor of the name a task gives is known to this worker."""

    exit_code = 3


class ProcessorRefused(AxError):
    """A task named a processor or callback host this worker is not allowed to run."""

    exit_code = 2


class CallbackFailed(AxError):
    """A callback_url answered with a non-2xx status, failed, or did not answer in time."""

    exit_code = 1


#: the longest delay a processor may ask for (as far ahead as ``ax.enqueue`` reaches)
MAX_DELAY_S = 3650 * 86_400.0


def delay_seconds(delay: float | timedelta, what: str) -> float:
    """``delay`` (seconds, or a timedelta) as seconds.

    Raises:
        ValidationError: not a number, not finite, negative, or past :data:`MAX_DELAY_S`.
    """
    if isinstance(delay, timedelta):
        delay = delay.total_seconds()
    if isinstance(delay, bool) or not isinstance(delay, (int, float)):
        raise ValidationError(f"{what} needs a delay in seconds (or a timedelta), got "
                              f"{type(delay).__name__}")
    if not (math.isfinite(delay) and 0 <= delay <= MAX_DELAY_S):
        raise ValidationError(f"{what}: delay must be within 0..{MAX_DELAY_S:.0f} s, got {delay}")
    return float(delay)


class ProcessorDirective(AxError):
    """Raised by a processor to say what its run's end means (Retry, Snooze, Discard)."""


class Retry(ProcessorDirective):
    """Retry the task after ``delay`` (None: its back-off); counted against ``max_retry``.

    Args:
        delay: seconds, or a timedelta, from the run's end (0 to 3650 days).
        reason: the run's error text (default: the delay).
    Raises:
        ValidationError: a bad delay (the run then fails as any other error does).
    """

    def __init__(self, delay: float | timedelta | None = None, reason: str = "") -> None:
        self.delay = None if delay is None else delay_seconds(delay, "Retry")
        self.reason = reason
        shown = f"retry in {self.delay:g} s" if self.delay is not None else "retry requested"
        super().__init__(reason or shown)

    def __reduce__(self) -> tuple[type[Retry], tuple[float | None, str]]:
        return type(self), (self.delay, self.reason)


class Snooze(ProcessorDirective):
    """Run the task again after ``delay``, no retry counted (past AX_MAX_SNOOZES: a failure).

    Args:
        delay: seconds, or a timedelta, from the run's end (0 to 3650 days).
        reason: the run's text in the history (default: the delay).
    Raises:
        ValidationError: a bad delay (the run then fails as any other error does).
    """

    def __init__(self, delay: float | timedelta, reason: str = "") -> None:
        self.delay = delay_seconds(delay, "Snooze")
        self.reason = reason
        super().__init__(reason or f"snoozed for {self.delay:g} s")

    def __reduce__(self) -> tuple[type[Snooze], tuple[float, str]]:
        return type(self), (self.delay, self.reason)


class Discard(ProcessorDirective):
    """Fail the task at once, whatever retries are left; ``reason`` is its last_error."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        super().__init__(reason or "discarded")

    def __reduce__(self) -> tuple[type[Discard], tuple[str]]:
        return type(self), (self.reason,)


class NodeNameInUse(AxError):
    """Another live process is registered under this node name (``-n``)."""

    exit_code = 6
