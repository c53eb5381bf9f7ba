"""Celery integration: ax as the ETA, countdown and beat backend of an existing Celery app.

Celery tasks and workers stay as they are; ax stores the delayed calls and, when
each is due, publishes a standard Celery message that an unmodified
``celery worker`` runs::

    import ax_kombu as ax
    from myapp import app, send_email

    ax.celery.install(app)                        # once, where the app is made
    send_email.apply_async(("a@b.c",), countdown=1800)   # stored in ax, not kept by a worker
    send_email.delay("a@b.c")                     # no eta/countdown: straight to Celery

    ax.celery.enqueue(app, "myapp.send_email", args=("a@b.c",), eta=when,
                      biz_key="welcome:42")       # the explicit form, with ax's options
    ax.celery.import_beat_schedule(app)           # beat_schedule → ax recurring jobs

Guarantees:

* A stored call is durable (in ax's database) and deduplicated like
  :func:`ax_kombu.enqueue` (``biz_key``; the same task, args and kwargs due within
  ``AX_DEDUP_WINDOW_MS`` of each other are one task).
* Dispatch is exactly once per attempt: the ax-scheduler whose claim moved the
  row publishes one Celery message, whose task id is derived from the ax task id
  and the attempt (:func:`ax_kombu.broker.celery_wire.celery_task_id`). For stock
  workers it is published when the task is due, never before: the scheduler claims it
  only once its trigger time has come on its database clock (:mod:`ax_kombu.store.claims`),
  so until then ``cancel`` wins, and the message has no ``eta``. For workers with the
  extension (below) it is staged as ax's own tasks are: published up to 1 s ahead
  (:data:`ax_kombu.core.runners.CELERY_AX_LEAD_MS`) with Celery's ``eta``, kept by the
  Celery worker's timer, and fenced at the due instant, so it starts on time (a cancel
  meanwhile still wins: the fence refuses it).
* Without the worker extension, once the broker has accepted that message the ax
  task is SUCCESS (its ``result`` names the Celery task id); from there on Celery's
  own semantics apply: at-least-once with ``acks_late``, at-most-once without,
  results in Celery's result backend.
* With it (``app.steps["worker"].add(ax.celery.AxBootstep)``), the Celery worker
  fences each run (RUNNING by compare-and-set on the attempt and the worker's live
  incarnation; a stale message is refused), records SUCCESS/FAILED, retries with ax's
  backoff, records a run whose pool process died, or that Celery revoked, and heartbeats,
  so ax's ack timeout and recovery cover Celery-run tasks (:mod:`ax_kombu.celery.bootstep`).

The broker: ax's scheduler publishes to ``AX_BROKER_URL`` (with
``AX_BROKER_KEY_PREFIX`` on Redis), so that must be the Celery app's broker (same
URL, and ``broker_transport_options={"global_keyprefix": …}`` if a prefix is set).
Celery is optional: this package's public names need it (``pip install
'ax_kombu[celery]'``), imported on first use; nothing else in ax imports Celery. The
scheduler's hand-off hook (:mod:`ax_kombu.celery.handoff`) needs no Celery.
"""

from __future__ import annotations

import importlib
from typing import Any

from ax_kombu.broker.celery_wire import celery_task_id

#: each public name, and the module it lives in (imported on first use: the scheduler imports
#: :mod:`ax_kombu.celery.handoff`, which needs no Celery, from this package)
_PUBLIC = {"AxBootstep": "bootstep", "import_beat_schedule": "beat", "install": "install",
           "installed": "install", "uninstall": "install", "async_result": "producer",
           "enqueue": "producer", "queue_of": "producer", "uses_bootstep": "producer"}

__all__ = ["AxBootstep", "async_result", "celery_task_id", "enqueue", "import_beat_schedule",
           "install", "installed", "queue_of", "uninstall", "uses_bootstep"]


def __getattr__(name: str) -> Any:
    """The public names but ``celery_task_id``, from their modules, which need Celery."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import celery  # noqa: F401  -- the real Celery: absolute imports resolve top-level
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("ax_kombu.celery needs Celery: pip install 'ax_kombu[celery]'") from exc
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # over the submodule of the same name (``install``) the import set
    return value
