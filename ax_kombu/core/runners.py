"""Who runs a task: the values of ``ax_task.runner``, and what each means to the core.

The ``runner`` column is the only source of truth for where a task runs and how it is
dispatched; no decision after enqueue reads a processor name. Each runner is a row of
:data:`RUNNERS`, data the store builds its SQL from (:mod:`ax_kombu.store.claims`), so the
claim statement names no runner:

* ``'ax'``: an ax worker runs the processor; ``'callback'``: an ax worker calls the URL.
  Both are claimed ``claim_lead_ms`` before they are due (the scheduler's setting) and
  staged by the worker until then.
* ``'celery'``: a stock Celery worker runs it (:mod:`ax_kombu.celery`). Nothing on that
  side could refuse it once cancelled after Celery has its message, so it is claimed only once
  due (lead 0), and its publish is recorded as its end (a *hand-off*,
  :mod:`ax_kombu.celery.handoff`).
* ``'celery_ax'``: a Celery worker running the AxBootstep runs it; published with Celery's
  ``eta`` :data:`CELERY_AX_LEAD_MS` ahead, fenced by the bootstep at the due instant.

The two Celery runners are written by :mod:`ax_kombu.celery` alone, from the route it
gives a task's ``processor_name`` (``celery:<queue>``, ``celery+ax:<queue>``): the one
place a route is read back into a runner is :func:`runner_of_route`, called when a row is
made (an enqueue, an occurrence of a recurring job), never afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

AX = "ax"
CALLBACK = "callback"
CELERY = "celery"
CELERY_AX = "celery_ax"

#: how far ahead of its trigger time a task for the bootstep's Celery workers is claimed and
#: published, whatever ``claim_lead_ms``: a stock Celery worker's one consuming thread can
#: trail by hundreds of ms on a busy host, and a message that arrives after its ``eta``
#: starts late, while keeping one in its timer costs little (docs/benchmarks.md, "Issue 16: a
#: Celery app's ETA through Celery vs through ax")
CELERY_AX_LEAD_MS = 1000

#: ``processor_name`` of a task routed to a Celery queue: this prefix, then the queue
CELERY_ROUTE = "celery:"
#: the same for a queue whose Celery workers run the AxBootstep
CELERY_AX_ROUTE = "celery+ax:"


@dataclass(frozen=True, slots=True)
class Runner:
    """What the core needs to know of one runner."""

    #: the value of ``ax_task.runner``
    name: str
    #: how long before its trigger time its tasks are claimed; None: the scheduler's
    #: ``claim_lead_ms``
    lead_ms: int | None = None
    #: its tasks go to ax's own priority queues (an ax worker acks them); False: another
    #: system consumes them (no ax heartbeat lists its consumers)
    ax_queues: bool = True
    #: the prefix of ``processor_name`` routing a task to it (None: not routed by name)
    route: str | None = None


#: every runner, by name
RUNNERS: dict[str, Runner] = {r.name: r for r in (
    Runner(AX),
    Runner(CALLBACK),
    Runner(CELERY, lead_ms=0, ax_queues=False, route=CELERY_ROUTE),
    Runner(CELERY_AX, lead_ms=CELERY_AX_LEAD_MS, ax_queues=False, route=CELERY_AX_ROUTE),
)}
#: the runners whose tasks go to a Celery queue as Celery messages
CELERY_RUNNERS = tuple(r.name for r in RUNNERS.values() if r.route is not None)
#: the runners claimed at a lead of their own (not ``claim_lead_ms``): name → lead (ms)
FIXED_LEADS: dict[str, int] = {r.name: r.lead_ms for r in RUNNERS.values()
                               if r.lead_ms is not None}
#: the runners whose tasks no ax worker consumes
OFF_AX_QUEUES = tuple(r.name for r in RUNNERS.values() if not r.ax_queues)


def route_to(runner: str, queue: str) -> str:
    """The ``processor_name`` routing a task of ``runner`` to ``queue``.

    Raises:
        KeyError: ``runner`` is not routed by name.
    """
    route = RUNNERS[runner].route
    if route is None:
        raise KeyError(runner)
    return route + queue


def runner_of_route(processor_name: str | None) -> str | None:
    """The runner a route written by :func:`route_to` names (None: not a route), for a row
    being made from a stored route (a recurring job's occurrence)."""
    if processor_name is None:
        return None
    for runner in RUNNERS.values():
        if runner.route is not None and processor_name.startswith(runner.route):
            return runner.name
    return None


def default_runner(callback_url: str | None) -> str:
    """The runner of a row that names none: ``'callback'`` with a callback URL, else ``'ax'``."""
    return CALLBACK if callback_url is not None else AX


def runner_for(processor_name: str | None, callback_url: str | None) -> str:
    """The runner of a row made from a stored target (a recurring job's occurrence): the one
    its route names (:func:`runner_of_route`), else :func:`default_runner`."""
    return runner_of_route(processor_name) or default_runner(callback_url)
