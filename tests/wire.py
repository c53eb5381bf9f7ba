"""Version-1 bodies, for tests: what a scheduler before version 2 published (every field of
the task's row, the payload included), still accepted by workers
(:mod:`ax_kombu.broker.messages`). ax no longer publishes them, so a test that needs one
(an upgrade, a forgery) builds it here."""

from __future__ import annotations

import json
from typing import Any

from ax_kombu.broker.messages import FULL_VERSION, WIRE_FIELDS, RawJson, TaskMessage


def version_1(message: TaskMessage) -> dict[str, Any]:
    """The version-1 body of ``message`` as a consumer decodes it (a RawJson payload is
    parsed)."""
    body: dict[str, Any] = {"v": FULL_VERSION}
    body.update((name, getattr(message, name)) for name in WIRE_FIELDS)
    if isinstance(message.payload, RawJson):
        body["payload"] = json.loads(message.payload)
    return body


def version_1_json(message: TaskMessage) -> str:
    """:func:`version_1` as the JSON text a scheduler sent."""
    return json.dumps(version_1(message), separators=(",", ":"), ensure_ascii=False)
