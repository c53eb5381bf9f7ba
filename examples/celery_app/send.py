"""Send delayed calls through ax: ``python send.py [N]`` (N calls, each 5 s from now)."""

from __future__ import annotations

import sys
import time

from tasks import app, send_email

import ax_kombu as ax

ax.celery.install(app)  # from here on, countdown/eta calls are stored in ax

n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
for i in range(n):
    due = time.time() + 5
    result = send_email.apply_async((f"user{i}@example.com", due), countdown=5)
print(f"{n} calls stored in ax; the last one's Celery id: {result.id}")
send_email.delay("now@example.com", time.time())  # no countdown: straight to Celery
