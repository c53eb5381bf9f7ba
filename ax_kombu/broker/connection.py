"""Connections and queues: how ax reaches the broker through Kombu.

Queues: one per priority — ``high``, ``default``, ``slow`` (names configurable)
— declared durable and bound to the default exchange, so a publish is a
single "put on queue" (no exchange lookup round trip).

:func:`check_broker_url` judges a broker URL at start-up the way Kombu will
when it connects, without connecting, so a URL that cannot work stops a
daemon at once instead of in its retry loop. :func:`backlogged` tells the
scheduler's recovery which queues still hold messages (a backlog is not a loss).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kombu import Connection, Queue
from kombu.transport import TRANSPORT_ALIASES
from kombu.utils.text import fmatch_best

from ax_kombu.broker.transports import register as register_transports
from ax_kombu.config import PRIORITIES, Settings, redact_url
from ax_kombu.exceptions import ConfigurationError

log = logging.getLogger(__name__)

_EXAMPLES = "use e.g. redis://host:6379/0, amqp://user:pass@host// or ax+sqlite:///path"
#: The Kombu extra that installs what a transport imports, where it has one.
_KOMBU_EXTRA = {"redis": "redis", "rediss": "redis", "sentinel": "redis", "sqla": "sqlalchemy",
                "sqlalchemy": "sqlalchemy", "sqs": "sqs", "SQS": "sqs", "mongodb": "mongodb",
                "zookeeper": "zookeeper", "confluentkafka": "confluentkafka",
                "gcpubsub": "gcpubsub", "pgmq": "pgmq"}


def connection(settings: Settings) -> Connection:
    """A (lazy) Kombu connection to the configured broker: ax's transport options, then
    ``AX_BROKER_TRANSPORT_OPTIONS`` over them."""
    register_transports()
    options: dict[str, Any] = {}
    if settings.broker_url.startswith(("redis", "rediss", "sentinel")):
        options["global_keyprefix"] = settings.broker_key_prefix
        options["socket_timeout"] = 10
        options["ack_emulation"] = settings.redis_ack_emulation
    options.update(settings.transport_options())
    return Connection(settings.broker_url, transport_options=options, connect_timeout=5)


def queue_arguments(settings: Settings) -> dict[str, Any]:
    """The arguments ax declares its queues with: on RabbitMQ, their type
    (``AX_RABBITMQ_QUEUE_TYPE``; classic needs none)."""
    if settings.rabbitmq_queue_type == "classic":
        return {}
    return {"x-queue-type": settings.rabbitmq_queue_type}


def task_queues(settings: Settings) -> dict[str, Queue]:
    """The kombu Queue for each priority."""
    arguments = queue_arguments(settings) or None
    return {p: Queue(settings.queue_for(p), routing_key=settings.queue_for(p), durable=True,
                     queue_arguments=arguments)
            for p in PRIORITIES}


def ensure_connected(conn: Any) -> None:
    """Connect ``conn``, trying each URL of a failover list (``amqp://a;amqp://b;…``) once
    in turn with no pause between them; a single URL is tried twice, as before."""
    conn.ensure_connection(max_retries=max(1, len(getattr(conn, "alt", None) or ()) - 1))


def queue_depths(settings: Settings) -> dict[str, int]:
    """Messages waiting in each priority's queue now (one short-lived connection).

    Raises:
        Exception: whatever Kombu raises when the broker cannot be asked.
    """
    with connection(settings) as conn:
        ensure_connected(conn)
        channel = conn.default_channel
        return {p: int(q(channel).queue_declare().message_count)
                for p, q in task_queues(settings).items()}


def backlogged(settings: Settings, priorities: Sequence[str]) -> set[str] | None:
    """The priorities among ``priorities`` whose queue holds messages now, or None if the
    broker could not be asked."""
    if not priorities:
        return set()
    try:
        depths = queue_depths(settings)
    except Exception:  # any broker failure means "unknown"
        log.debug("could not read the queues' depths", exc_info=True)
        return None
    return {p for p in priorities if depths[p] > 0}


def declare_queues(conn: Connection, settings: Settings) -> None:
    channel = conn.default_channel
    for queue in task_queues(settings).values():
        queue(channel).declare()


def check_broker_url(url: str) -> None:
    """Fail now if Kombu could never use ``url``; reaching its server is not tried.

    Each URL of a ``;``-separated failover list must name a transport Kombu
    knows (ax's ``ax+sqlite`` alias included), whose module and client library
    import, and must parse as that transport reads it: Kombu's own
    resolution builds the transport object, which is everything short of
    connecting. A server that is down passes here and is met, with retries,
    when the daemon connects.

    Raises:
        ConfigurationError: not a URL, an unknown transport, a transport whose
            modules cannot be imported, or a URL the transport cannot parse.
            The message shows the URL with its password redacted.
    """
    register_transports()
    for one in url.split(";"):
        _check_one(one.strip())


def _check_one(url: str) -> None:
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        raise ConfigurationError(f"not a broker URL: {redact_url(url)!r} ({_EXAMPLES})")
    name = scheme.partition("+")[0]  # as Kombu splits ax+sqlite:// or sqla+postgresql://
    conn = None
    try:
        conn = Connection(url)
        conn.transport  # noqa: B018  -- imports the transport, which parses the URL
    except KeyError:
        raise ConfigurationError(_unknown(name)) from None
    except (ImportError, AttributeError) as exc:
        extra = _KOMBU_EXTRA.get(name)
        hint = f" (pip install 'kombu[{extra}]')" if extra else ""
        raise ConfigurationError(redact_url(f"the {name!r} transport cannot be loaded: "
                                            f"{exc}{hint}")) from None
    except ValueError as exc:
        why = str(exc)  # the ax+sqlite transport's own message already shows the URL
        shown = why if url in why else f"malformed broker URL {url!r}: {why}"
        raise ConfigurationError(redact_url(shown)) from None
    finally:
        if conn is not None:
            conn.release()


def _unknown(name: str) -> str:
    guess = fmatch_best(name, TRANSPORT_ALIASES)
    maybe = f"did you mean {guess}://? " if guess else ""
    return f"unknown transport {name!r} ({maybe}{_EXAMPLES})"
