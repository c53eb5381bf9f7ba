"""The Celery app of :mod:`bench.celery_countdown`: :mod:`bench.celery_app`'s, with the AxBootstep.

    celery -A bench.celery_ax_app worker -P threads -c 16 -Q <queue>

Configured as :mod:`bench.celery_app` (``AXBENCH_CELERY_*``), plus the ``AX_*`` variables the
bootstep reads (``AX_DATABASE_URL`` …).
"""

from __future__ import annotations

from ax_kombu.celery import AxBootstep

from .celery_app import app

app.steps["worker"].add(AxBootstep)
