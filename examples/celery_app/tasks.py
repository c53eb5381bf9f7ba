"""A tiny Celery app whose delayed calls and beat schedule go through ax.

The worker is plain Celery: ``celery -A tasks worker -Q celery`` (run from this folder). The
producer side calls ``ax.celery.install(app)`` (``send.py``); ``beat.py`` imports the beat
schedule into ax. Broker: ``CELERY_BROKER_URL`` (default ``redis://127.0.0.1:6379/0``), the
same URL ax-scheduler publishes to (``AX_BROKER_URL``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from celery import Celery
from celery.schedules import crontab

app = Celery("tasks", broker=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)
app.conf.beat_schedule = {
    "report.hourly": {"task": "tasks.report", "schedule": crontab(minute=0), "args": ("hourly",)},
    "heartbeat": {"task": "tasks.report", "schedule": timedelta(seconds=10),
                  "args": ("every 10 s",)},
}


@app.task(bind=True)
def send_email(self: Any, to: str, due: float) -> None:
    late_ms = (time.time() - due) * 1000
    print(f"send_email to={to} celery_id={self.request.id} "
          f"ax_task={self.request.get('ax_task_id')} late={late_ms:.0f} ms", flush=True)


@app.task
def report(kind: str) -> None:
    print(f"report {kind} at {time.strftime('%H:%M:%S')}", flush=True)
