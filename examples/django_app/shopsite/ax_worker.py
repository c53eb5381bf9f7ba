"""What ``ax-worker -A shopsite.ax_worker`` imports: Django set up, then the shop's tasks.

As with Celery's ``-A proj``, the worker process loads the Django project first (settings,
apps, database), so a task may use the ORM like any view does.
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")
django.setup()

from shop import tasks  # noqa: F401 - registers the typed tasks with the worker
