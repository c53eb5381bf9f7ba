"""``enqueue(..., connection=django.db.connection)``: inside ``transaction.atomic()`` the
task commits or rolls back with the block (a nested block that raises takes its task back
to the savepoint); outside one it is a ValidationError and nothing is written
(:mod:`ax_kombu.store.borrowed`).

Django's settings are process-wide: this module configures them only if nothing else in the
process has (pointing ``default`` at the test's PostgreSQL database), and closes Django's
connections when it is done. Skipped without Django (``pip install 'ax_kombu[test]'``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import make_url, text

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.core.states import Status
from ax_kombu.exceptions import TaskNotFound, ValidationError

django = pytest.importorskip("django")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def dj(pg_database: str) -> Iterator[Any]:
    """``django.db.connection`` on the test's database."""
    from django.conf import settings

    url = make_url(pg_database)
    if not settings.configured:
        settings.configure(
            DATABASES={"default": {
                "ENGINE": "django.db.backends.postgresql", "NAME": url.database,
                "USER": url.username or "", "PASSWORD": url.password or "",
                "HOST": url.host or "", "PORT": str(url.port or 5432)}},
            INSTALLED_APPS=[], USE_TZ=True)
        django.setup()
    elif settings.DATABASES.get("default", {}).get("NAME") != url.database:
        pytest.skip("Django is already configured for another database in this process")
    from django.db import connection, connections

    yield connection
    connections.close_all()


@pytest.fixture
def client(pg_url: str) -> Iterator[Client]:
    c = Client(from_env({}, database_url=pg_url))
    yield c
    c.close()


def _tasks(client: Client) -> int:
    """How many tasks another session sees."""
    with client.store.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM ax_task")).scalar_one())


def _app_write(dj: Any, order_id: int) -> None:
    """The app's own write in the same transaction (a table of this connection's own)."""
    with dj.cursor() as cur:
        cur.execute("CREATE TEMP TABLE IF NOT EXISTS shop_order (id int)")
        cur.execute("INSERT INTO shop_order VALUES (%s)", [order_id])


def _app_rows(dj: Any) -> list[int]:
    with dj.cursor() as cur:
        cur.execute("SELECT to_regclass('pg_temp.shop_order') IS NOT NULL")
        if not cur.fetchone()[0]:
            return []
        cur.execute("SELECT id FROM shop_order ORDER BY id")
        return [row[0] for row in cur.fetchall()]


def test_a_task_enqueued_inside_atomic_commits_with_the_block(dj: Any,
                                                              client: Client) -> None:
    from django.db import transaction

    with transaction.atomic():
        _app_write(dj, 42)
        task = client.enqueue("order.close", {"order": 42}, delay=60, biz_key="42",
                              connection=dj)
        assert task.created
        assert _tasks(client) == 0, "seen by another session before the commit"
    view = client.get(task)
    assert view.status is Status.DELAYED and view.biz_key == "42"
    assert _app_rows(dj) == [42]
    with dj.cursor() as cur:
        cur.execute("DROP TABLE shop_order")


def test_an_atomic_block_that_raises_leaves_no_task(dj: Any, client: Client) -> None:
    from django.db import transaction

    with pytest.raises(RuntimeError), transaction.atomic():
        _app_write(dj, 43)
        task = client.enqueue("order.close", {"order": 43}, delay=60, biz_key="43",
                              connection=dj)
        raise RuntimeError("the payment provider is down")
    with pytest.raises(TaskNotFound):
        client.get(task)
    assert _tasks(client) == 0 and _app_rows(dj) == []
    # the key was never taken: the same order can be enqueued again
    with transaction.atomic():
        assert client.enqueue("order.close", {"order": 43}, delay=60, biz_key="43",
                              connection=dj).created


def test_a_nested_block_that_raises_takes_back_only_its_own_task(dj: Any,
                                                                  client: Client) -> None:
    from django.db import transaction

    with transaction.atomic():
        kept = client.enqueue("order.close", {"order": 1}, delay=60, connection=dj)
        with pytest.raises(RuntimeError), transaction.atomic():  # a savepoint
            undone = client.enqueue("order.close", {"order": 2}, delay=60, connection=dj)
            raise RuntimeError("this line item failed")
    assert client.get(kept).status is Status.DELAYED
    with pytest.raises(TaskNotFound):
        client.get(undone)


def test_outside_atomic_it_is_refused_and_nothing_is_written(dj: Any,
                                                             client: Client) -> None:
    assert dj.get_autocommit()
    with pytest.raises(ValidationError, match="atomic"):
        client.enqueue("order.close", {"order": 44}, delay=60, biz_key="44", connection=dj)
    assert _tasks(client) == 0
