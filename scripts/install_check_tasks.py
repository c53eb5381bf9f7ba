"""The processor scripts/install_check.sh runs: ``ax-worker -A install_check_tasks``.

Deliberately trivial: the check is about the plain install (its dependencies,
entry points, migrations and broker transports), not about the work itself.
"""

from __future__ import annotations

from typing import Any

import ax_kombu as ax


@ax.processor("install.check")
def install_check(payload: dict[str, Any], ctx: Any) -> None:
    """Succeeds if the payload is the one install_check.sh enqueued."""
    if not isinstance(payload, dict) or "n" not in payload:
        raise ValueError(f"unexpected payload: {payload!r}")
