"""The duplicate check's key, pure: a payload as canonical JSON, and the fingerprint of a
task type with it.

:func:`canonical_json` refuses what JSON would change or a worker refuse (see
:func:`check_payload`), so a payload accepted here reads back the same everywhere, and
two payloads equal as JSON values (whatever their key order) have one fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ax_kombu.core.errors import ValidationError
from ax_kombu.core.values import check_utf8

#: deepest nesting of lists/objects in a payload, and most values (containers and scalars) in
#: it: within what a worker accepts in a message (ax_kombu.broker.rejects: 64 levels for the
#: whole body, 100,000 values), so an accepted task can never be refused on its way
MAX_PAYLOAD_DEPTH = 32
MAX_PAYLOAD_VALUES = 100_000
#: integers in a payload: 64-bit, so every JSON decoder (orjson included) reads them back exactly
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)

def check_payload(payload: Any) -> None:
    """Refuse what JSON would change or a worker refuse: nesting deeper than
    ``MAX_PAYLOAD_DEPTH``, more than ``MAX_PAYLOAD_VALUES`` values, non-string keys,
    integers beyond 64 bits, text that is not valid Unicode."""
    stack: list[tuple[Any, int]] = [(payload, 0)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_PAYLOAD_VALUES:
            raise ValidationError(f"payload holds more than {MAX_PAYLOAD_VALUES} values")
        if isinstance(value, str):
            check_utf8("payload", value)
        elif isinstance(value, bool) or value is None or isinstance(value, float):
            continue  # NaN/Infinity: json.dumps(allow_nan=False) refuses them
        elif isinstance(value, int):
            if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
                raise ValidationError("payload holds an integer beyond 64 bits; "
                                      "pass it as a string")
        elif isinstance(value, (Mapping, list, tuple)):
            if depth >= MAX_PAYLOAD_DEPTH:
                raise ValidationError(f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} "
                                      "levels")
            if isinstance(value, Mapping):
                for key in value:
                    if not isinstance(key, str):
                        raise ValidationError("payload keys must be strings, got "
                                              f"{type(key).__name__}")
                    check_utf8("payload", key)
                stack.extend((item, depth + 1) for item in value.values())
            else:
                stack.extend((item, depth + 1) for item in value)
        # anything else: json.dumps says whether it is serialisable


def canonical_json(payload: Any, limit: int) -> str:
    """The payload as compact JSON with sorted keys (so key order never matters).

    Raises:
        ValidationError: not JSON-serialisable, NaN/Infinity, non-string keys, integers
            beyond 64 bits, nested deeper than ``MAX_PAYLOAD_DEPTH``, or over ``limit``
            bytes.
    """
    check_payload(payload)
    try:
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValidationError(f"payload is not JSON-serialisable: {exc}") from None
    size = len(text.encode())
    if size > limit:
        raise ValidationError(f"payload is {size} bytes encoded; the limit is {limit} "
                              "(AX_MAX_PAYLOAD_BYTES)")
    return text


def fingerprint(task_type: str, payload_json: str) -> str:
    """128-bit hex digest of the task type and canonical payload."""
    return hashlib.blake2b(f"{task_type}\0{payload_json}".encode(), digest_size=16).hexdigest()
