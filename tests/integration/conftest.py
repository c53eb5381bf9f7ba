"""Fixtures shared by the integration tests: a client on the test's store, and a dispatcher
for the tests that drive a worker with hand-made dispatches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from ax_kombu.api import Client
from ax_kombu.broker.connection import connection, declare_queues
from ax_kombu.config import Settings

if TYPE_CHECKING:
    from .test_worker import Dispatch


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    """A client on this test's store (``settings``), closed afterwards."""
    c = Client(settings)
    yield c
    c.close()


@pytest.fixture
def dispatch(settings: Settings) -> Iterator[Dispatch]:
    """Claims and publishes tasks as a scheduler would, on the test's own queues."""
    from .test_worker import Dispatch

    with connection(settings) as conn:
        declare_queues(conn, settings)
    d = Dispatch(settings)
    yield d
    d.close()
