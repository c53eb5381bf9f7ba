"""Every error ax raises on purpose derives from :class:`AxError`.

The CLI turns an ``AxError`` into a one-line message and a non-zero exit code;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


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


class StoreError(AxError):
    """The task store could not be reached or refused an operation."""

    exit_code = 5


class IdExhausted(AxError):
    """No snowflake node id could be leased (all 1024 are held)."""

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


class NodeNameInUse(AxError):
    """Another live process is registered under this node name (``-n``)."""

    exit_code = 6
