"""Redaction: what ax shows of a URL or an error text (logs, CLI output, the console,
``last_error``): passwords and query-string values replaced by ``***``.

Every place that prints a connection URL, or an error that may hold one, passes it through
:func:`redact_url`; a secret setting (``callback_secret``) is never printed at all.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

#: a URL inside any text: scheme://… up to whitespace or a quote. The scheme is bounded
#: (RFC 3986 sets no limit; real ones are short): unbounded, every letter of a long run
#: without ``://`` started a scan to the run's end, quadratic in the run's length
#: (docs/benchmarks.md, "Figures moved out of the code").
#: A longer scheme is matched by its last 32 characters, which redacts the same.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s'\"<>]*")
#: ``user:password@``, up to the first ``@`` after the colon; searched only up to the last
#: ``@`` of the URL (see :func:`_hide_userinfo`)
_USERINFO = re.compile(r"(://[^:/@]*:)[^@]*@")
#: one ``key=value`` of a query string
_QUERY_PAIR = re.compile(r"(^|[&;])([^=&;]*)=([^&;]*)")
#: query keys whose values are never secret and help an operator (TLS mode, timeouts)
SAFE_QUERY_KEYS = frozenset({"sslmode", "ssl_cert_reqs", "ssl_check_hostname", "connect_timeout",
                             "application_name", "target_session_attrs", "heartbeat", "timeout",
                             "socket_timeout", "socket_connect_timeout", "ssl", "tls"})
#: ``password=…`` outside a URL (a libpq key/value DSN)
_KV_PASSWORD = re.compile(r"(\bpassword\s*=\s*)(?!\*\*\*)[^\s'\"&;,)]+", re.IGNORECASE)


def _redact_pair(match: re.Match[str]) -> str:
    sep, key, _value = match.groups()
    return match.group(0) if key.lower() in SAFE_QUERY_KEYS else f"{sep}{key}=***"


def _hide_userinfo(url: str) -> str:
    """``url`` with each ``user:password@`` hidden. Searched only up to the last ``@``:
    past it no match can end, and each ``://x:`` there would have cost a scan to the
    end of the URL (quadratic on a long one)."""
    last = url.rfind("@")
    if last < 0:
        return url
    return _USERINFO.sub(r"\1***@", url[:last + 1]) + url[last + 1:]


def _redact_one(match: re.Match[str]) -> str:
    url = _hide_userinfo(match.group(0))
    head, question, rest = url.partition("?")
    if not question:
        return url
    query, hash_, fragment = rest.partition("#")
    return f"{head}?{_QUERY_PAIR.sub(_redact_pair, query)}{hash_}{fragment}"


def redact_url(url: str) -> str:
    """``url`` safe for logs, CLI output and ``last_error``: any password and every
    query-string value (except :data:`SAFE_QUERY_KEYS`) replaced by ``***``.

    ``url`` may also be any text that contains URLs (a log line, an error message):
    each URL in it is redacted, and so is a ``password=…`` pair outside a URL::

        >>> redact_url("redis://:pw@h:6379/0 and https://x/cb?token=t&sslmode=require")
        'redis://:***@h:6379/0 and https://x/cb?token=***&sslmode=require'
    """
    return _KV_PASSWORD.sub(r"\1***", _URL_IN_TEXT.sub(_redact_one, url))


def url_origin(url: str) -> str:
    """``url`` as ``scheme://host[:port]/…``: no user, path or query (they may hold a
    token); ``/…`` only when something was left out."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "(not a URL)"
    if ":" in host:
        host = f"[{host}]"
    more = parts.path not in ("", "/") or parts.query or parts.fragment
    return f"{parts.scheme}://{host}{port}/{'…' if more else ''}"
