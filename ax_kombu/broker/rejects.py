"""Messages a worker refuses before they reach the database, and the one reason for each.

Anyone who can write to a queue can put anything there, so a worker judges
every message before it spends more than a length check on it:

1. **size** (``too_large``): a body over :func:`body_limit` bytes (1 MiB, or
   4 × ``max_payload_bytes`` if that is more) is refused before it is decoded;
   on Redis a popped value over :func:`envelope_limit` is refused before even
   its envelope is parsed;
2. **content type** (``content_type``): JSON only, uncompressed, UTF-8 — a
   pickle, YAML, msgpack or compressed message is never decoded;
3. **JSON** (``not_json``): the body does not parse (or is not UTF-8);
4. **shape** (``too_deep``, ``too_large``): a body nested more than
   :data:`MAX_DEPTH` levels, or holding more than :data:`MAX_VALUES` values;
5. **fields** (:meth:`ax_kombu.broker.messages.TaskMessage.from_body`): not an
   ax message (``not_task``), a field missing (``missing_field``), of the
   wrong type (``wrong_type``: integers are integers and not booleans,
   strings are strings), or out of range (``bad_value``: attempt ≥ 1, a known
   priority, lengths within the task table's columns, …).

``not_kombu`` is a value on a Redis list that is not a Kombu envelope at all.
A well-formed message for a task that does not exist is refused by the
RUNNING compare-and-set like a stale one, and counted as ``unknown_task``.

Each refused message is logged once with its reason, counted once in
``ax_rejected_messages_total{reason}`` and removed from the broker (acked, or
rejected without requeue, so a RabbitMQ dead-letter exchange set by policy
receives it): never requeued, so it cannot come back in a loop, and the
worker's room for it is freed at once.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

#: every reason a message is refused for (the ``reason`` label of the counter)
REASONS = ("not_kombu", "too_large", "content_type", "not_json", "too_deep", "not_task",
           "missing_field", "wrong_type", "bad_value", "unknown_task")

#: the smallest body limit, whatever ``max_payload_bytes`` says
MIN_BODY_LIMIT = 1 << 20
#: most nesting levels in a body (the message object itself is the first)
MAX_DEPTH = 64
#: most values (containers and scalars) in a body's payload
MAX_VALUES = 100_000
#: the content encodings a JSON body may declare
_ENCODINGS = (None, "", "utf-8", "utf8", "UTF-8")


class Rejected(ValueError):
    """A message that is not an ax task message, with the reason it is refused."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def body_limit(max_payload_bytes: int) -> int:
    """Most bytes a task message's body may have: room for the largest payload and the rest."""
    return max(MIN_BODY_LIMIT, 4 * max_payload_bytes)


def envelope_limit(body_bytes: int) -> int:
    """Most bytes a popped Redis value may have (its body is JSON-escaped inside it)."""
    return 2 * body_bytes + 65536


def check_size(size: int, limit: int, what: str = "body") -> None:
    """Raise :class:`Rejected` (``too_large``) if ``size`` is over ``limit``."""
    if size > limit:
        raise Rejected("too_large", f"{what} of {size} bytes, over the limit of {limit}")


def decode_body(body: bytes | str | None, content_type: str | None,
                content_encoding: str | None, headers: dict[str, Any] | None,
                limit: int) -> Any:
    """A received body → its JSON value; what it cannot be is refused, cheapest check first.

    Raises:
        Rejected: with the reason (``too_large``, ``content_type``, ``not_json``,
            ``too_deep``).
    """
    if body is None:
        body = b""
    check_size(len(body), limit)
    if content_type != "application/json" or content_encoding not in _ENCODINGS:
        raise Rejected("content_type", f"content type {content_type!r} encoded "
                                       f"{content_encoding!r} (only UTF-8 JSON is accepted)")
    if headers and "compression" in headers:
        raise Rejected("content_type", f"compressed ({headers['compression']!r})")
    try:
        value = _loads(body)
    except RecursionError:
        raise Rejected("too_deep", "nested too deep to decode") from None
    except ValueError as exc:  # also UnicodeDecodeError
        raise Rejected("not_json", f"not JSON: {str(exc)[:200]}") from None
    check_shape(value)
    return value


def _loads(body: bytes | str) -> Any:
    """JSON text → value. orjson (a fraction of the standard decoder's time) for what ax
    publishes; the standard decoder wherever they could differ: text orjson refuses (its
    error, or NaN, which the standard decoder accepts), a body with a payload (the user's
    data: orjson turns an integer over 64 bits into a float) and a float among an object's
    fields (a field that should be an integer is then refused for the reason it really has)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)
    if type(value) is dict and ("payload" in value
                                or any(type(v) is float for v in value.values())):
        return json.loads(body)
    return value


def check_shape(value: Any) -> None:
    """Refuse a decoded value nested over MAX_DEPTH levels or holding over MAX_VALUES values.

    A task message is a flat object whose payload may nest; a small flat
    payload costs a few type checks here.

    Raises:
        Rejected: ``too_deep`` or ``too_large``.
    """
    if type(value) is dict:
        payload = value.get("payload")
        if type(payload) not in (dict, list):
            return  # the message's other fields are scalars: from_body checks each
        todo: list[tuple[Any, int]] = [(payload, 2)]
    elif type(value) is list:
        todo = [(value, 1)]
    else:
        return
    count = 0
    while todo:
        node, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise Rejected("too_deep", f"nested over {MAX_DEPTH} levels")
        items = node.values() if type(node) is dict else node
        count += len(items)
        if count > MAX_VALUES:
            raise Rejected("too_large", f"over {MAX_VALUES} values")
        todo.extend((item, depth + 1) for item in items if type(item) in (dict, list))
