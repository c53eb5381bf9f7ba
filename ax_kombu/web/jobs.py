"""Recurring jobs: each with its schedule, next 5 fire times and last occurrence; pause and
resume (``ax jobs pause|resume``: :meth:`Client.pause`, :meth:`Client.resume`), and "run
now" (``ax jobs run``: :meth:`Client.run_job_now`): one occurrence of the job due at once,
written as the scheduler writes occurrences (same row, same strategy gate, same unique
``(job, scheduled_at)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ax_kombu.api import Client
from ax_kombu.recurring import JobView
from ax_kombu.views import TaskView
from ax_kombu.web.console import OPERATE, audited, back_to, checked_form, console_of

NEXT_FIRES = 5


def job_view(client: Client, job: JobView) -> dict[str, Any]:
    """A job with its next fire times and its last occurrence (None: none yet)."""
    last: list[TaskView] = client.occurrences(job.name, 1)
    upcoming = [] if job.broken else client.next_fires(job.name, NEXT_FIRES)
    return {"job": job, "next": upcoming, "last": last[0] if last else None}


def job_list(request: Request) -> Response:
    client = console_of(request).client
    found = [job_view(client, job) for job in client.jobs()]
    return console_of(request).page(request, "jobs.html", jobs=found)


def _action(work: Callable[[Client, str], Any], note: str, action: str) -> Callable[..., Any]:
    """A POST endpoint (an operator's) that calls ``work(client, job name)``, records it,
    then shows the jobs again."""
    async def endpoint(request: Request) -> Response:
        await checked_form(request, OPERATE)
        name = request.path_params["name"]
        done = await run_in_threadpool(work, console_of(request).client, name)
        await audited(request, action, f"job:{name}",
                      {"task_id": done} if isinstance(done, int) else None)
        return back_to("/jobs", note)
    return endpoint


ROUTES = [Route("/jobs", job_list, methods=["GET"]),
          Route("/jobs/{name}/pause", _action(Client.pause, "paused", "job_pause"),
                methods=["POST"]),
          Route("/jobs/{name}/resume", _action(Client.resume, "resumed", "job_resume"),
                methods=["POST"]),
          Route("/jobs/{name}/run", _action(Client.run_job_now, "started", "job_run"),
                methods=["POST"])]
