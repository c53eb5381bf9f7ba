"""Kombu transports shipped with ax_kombu.

Call :func:`register` once per process, before creating a
:class:`kombu.Connection` for one of these URLs:

* ``ax+sqlite:///path/to/broker.db`` -- :mod:`ax_kombu.broker.sqlite`,
  a server-free broker stored in a SQLite file and shared by every process
  on the machine that opens the same file.
"""
from __future__ import annotations

#: URL scheme prefix (``ax+sqlite:///...``) and the class it resolves to.
ALIAS = 'ax'
TARGET = 'ax_kombu.broker.sqlite:Transport'


def register() -> None:
    """Register the ``ax`` transport alias with Kombu (idempotent)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES[ALIAS] = TARGET
