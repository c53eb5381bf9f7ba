"""Replace ``celery beat``: ``python beat.py`` makes ax jobs of ``app.conf.beat_schedule``
(idempotent: run it at every deploy); any number of ax-schedulers then fire them."""

from __future__ import annotations

from tasks import app

import ax_kombu as ax

for job in ax.celery.import_beat_schedule(app):
    print(f"{job.name}: next at {ax.next_fires(job.name, 1)[0]:%Y-%m-%d %H:%M:%S %Z}")
