"""Settings of the shop example: one PostgreSQL database, which is also ax's.

The order and its close task commit in one transaction only if both live in one database,
so ``DATABASES["default"]`` is read from ``AX_DATABASE_URL`` (the URL ax itself uses).
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

_url = urlsplit(os.environ.get("AX_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/shop"))

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
INSTALLED_APPS = ["shop"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "shopsite.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or 5432),
    }
}

#: seconds an order may stay unpaid before its close task runs
ORDER_CLOSE_AFTER_S = float(os.environ.get("ORDER_CLOSE_AFTER_S", "1800"))
