"""Every error ax raises on purpose derives from :class:`AxError`.

The CLI turns an ``AxError`` into a one-line message and a non-zero exit code;
anything else is a bug and keeps its traceback. The classes live in
:mod:`ax_kombu.core.errors`, so that the pure core raises them without importing
anything outside it; this module is where users and the rest of the package import them.
"""

from __future__ import annotations

from ax_kombu.core.errors import (
    AxError,
    CallbackFailed,
    ConfigurationError,
    Discard,
    IdExhausted,
    IllegalTransition,
    JobNotFound,
    NodeNameInUse,
    ProcessorDirective,
    ProcessorNotFound,
    ProcessorRefused,
    Retry,
    Snooze,
    StoreError,
    TaskNotFound,
    TooLateToMove,
    ValidationError,
    WaitTimeout,
)

__all__ = [
    "AxError",
    "CallbackFailed",
    "ConfigurationError",
    "Discard",
    "IdExhausted",
    "IllegalTransition",
    "JobNotFound",
    "NodeNameInUse",
    "ProcessorDirective",
    "ProcessorNotFound",
    "ProcessorRefused",
    "Retry",
    "Snooze",
    "StoreError",
    "TaskNotFound",
    "TooLateToMove",
    "ValidationError",
    "WaitTimeout",
]
