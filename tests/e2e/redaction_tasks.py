"""A processor for :mod:`tests.e2e.test_redaction` (``-A tests.e2e.redaction_tasks``): it logs
and raises with a secret-bearing URL, as code calling an API with a token in its query would."""

from __future__ import annotations

import logging
from typing import Any

import ax_kombu as ax
from ax_kombu.worker.processors import Context

log = logging.getLogger(__name__)


@ax.processor("redaction.leaky")
def leaky(payload: dict[str, Any], ctx: Context) -> None:
    url = payload["url"]
    log.warning("calling %s for task %s", url, ctx.task_id)
    raise RuntimeError(f"could not reach {url}: 503 from upstream")
