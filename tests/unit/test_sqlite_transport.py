"""Tests for the server-free SQLite Kombu transport (``ax+sqlite://``)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from ax_kombu.broker.transports import register
from tests.waiting import eventually

REPO_ROOT = Path(__file__).resolve().parents[2]
TABLE = 'ax_kombu_message'

# Code run by the child processes (``python -c CHILD <role> ...``).
CHILD = r'''
import json, os, sys
from ax_kombu.broker.transports import register
register()
from kombu import Connection, Consumer, Producer, Queue


def produce(url, queue, prefix, count):
    sys.stdin.readline()  # wait until the parent says "go"
    with Connection(url) as conn:
        producer = Producer(conn)
        for i in range(int(count)):
            producer.publish({'id': f'{prefix}-{i}'}, routing_key=queue,
                             serializer='json', headers={'seq': i})


def consume(url, queue, out, stop):
    received = []

    def on_message(body, message):
        received.append(body['id'])
        message.ack()

    with Connection(url) as conn:
        with Consumer(conn, [Queue(queue, routing_key=queue)],
                      callbacks=[on_message]):
            open(out + '.ready', 'w').close()
            while not os.path.exists(stop):
                try:
                    conn.drain_events(timeout=0.05)
                except TimeoutError:
                    pass
    with open(out + '.tmp', 'w') as f:
        json.dump(received, f)
    os.replace(out + '.tmp', out)


def take_and_hang(url, queue, marker, vt):
    conn = Connection(url, transport_options={'visibility_timeout': float(vt)})
    message = conn.SimpleQueue(queue).get(timeout=10)
    with open(marker, 'w') as f:
        f.write(message.payload['id'])
    sys.stdin.readline()  # killed with SIGKILL while waiting here


{'produce': produce, 'consume': consume,
 'take_and_hang': take_and_hang}[sys.argv[1]](*sys.argv[2:])
'''


@pytest.fixture(autouse=True)
def _registered() -> None:
    register()


def url_for(path: Path) -> str:
    return f'ax+sqlite:///{path}'  # path is absolute: four slashes in all


def spawn(tmp_path: Path, name: str, *args: str,
          stdin: int | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get('PYTHONPATH')) if p)
    with open(tmp_path / f'{name}.out', 'wb') as out, \
            open(tmp_path / f'{name}.err', 'wb') as err:
        return subprocess.Popen([sys.executable, '-c', CHILD, *args],
                                env=env, stdin=stdin, stdout=out, stderr=err)


def rows_in(db_path: Path) -> int:
    with sqlite3.connect(db_path) as db:
        return db.execute(f'SELECT count(*) FROM {TABLE}').fetchone()[0]


def ready_count(conn: Connection, queue: str) -> int:
    return conn.default_channel.queue_declare(
        queue=queue, passive=True).message_count


def stderr_of(tmp_path: Path, names: list[str]) -> str:
    return '\n'.join(
        f'--- {n}:\n' + (tmp_path / f'{n}.err').read_text() for n in names)


@pytest.mark.timeout(120)
def test_round_trip_default_exchange(tmp_path: Path) -> None:
    db_path = tmp_path / 'broker.db'
    body = {'task': 'ax.ping', 'args': [1, 'two'], 'when': '2024-01-01T00:00'}
    headers = {'ax-task-id': 'T-1', 'attempt': 3}
    got = []
    with Connection(url_for(db_path)) as conn:
        Producer(conn).publish(body, exchange='', routing_key='ax.tasks',
                               headers=headers, serializer='json')
        assert rows_in(db_path) == 1
        queue = Queue('ax.tasks', Exchange(''), routing_key='ax.tasks')
        with Consumer(conn, [queue], callbacks=[
                lambda b, m: got.append((b, m))]):
            conn.drain_events(timeout=5)
        assert len(got) == 1
        received, message = got[0]
        assert received == body
        assert message.headers == headers
        assert message.content_type == 'application/json'
        assert message.delivery_info['routing_key'] == 'ax.tasks'
        assert not message.acknowledged
        message.ack()
        assert message.acknowledged
        assert ready_count(conn, 'ax.tasks') == 0
    assert rows_in(db_path) == 0


@pytest.mark.timeout(120)
def test_priority_then_fifo(tmp_path: Path) -> None:
    with Connection(url_for(tmp_path / 'b.db')) as conn:
        producer = Producer(conn)
        for n, priority in enumerate([0, 5, 0, 9, 5]):
            producer.publish({'n': n}, routing_key='q', priority=priority)
        simple = conn.SimpleQueue('q')
        order = []
        for _ in range(5):
            message = simple.get(timeout=5)
            order.append(message.payload['n'])
            message.ack()
        assert order == [3, 1, 4, 0, 2]
        with pytest.raises(simple.Empty):
            simple.get(block=False)


@pytest.mark.timeout(120)
def test_many_processes_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    n_producers, n_consumers, per_producer = 3, 3, 3000
    db_path, queue = tmp_path / 'broker.db', 'ax.load'
    url, stop = url_for(db_path), tmp_path / 'stop'
    outs = [tmp_path / f'consumer{i}.json' for i in range(n_consumers)]
    consumers = [spawn(tmp_path, f'consumer{i}', 'consume', url, queue,
                       str(out), str(stop)) for i, out in enumerate(outs)]
    producers = [spawn(tmp_path, f'producer{i}', 'produce', url, queue,
                       f'p{i}', str(per_producer), stdin=subprocess.PIPE)
                 for i in range(n_producers)]
    names = [f'consumer{i}' for i in range(n_consumers)] + [
        f'producer{i}' for i in range(n_producers)]
    try:
        # All consumers are polling before any message is published.
        eventually(lambda: all(Path(f'{o}.ready').exists() for o in outs),
                 60, 'consumers to start')
        for p in producers:
            p.stdin.write(b'go\n')
            p.stdin.close()
        for p in producers:
            assert p.wait(timeout=90) == 0, stderr_of(tmp_path, names)
        with Connection(url) as conn:
            eventually(lambda: ready_count(conn, queue) == 0, 60,
                     'the queue to drain')
        stop.touch()
        for c in consumers:
            assert c.wait(timeout=30) == 0, stderr_of(tmp_path, names)
    finally:
        for proc in consumers + producers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    per_consumer = [json.loads(o.read_text()) for o in outs]
    counts = Counter(i for ids in per_consumer for i in ids)
    sent = {f'p{p}-{i}' for p in range(n_producers)
            for i in range(per_producer)}
    duplicated = [i for i, n in counts.items() if n > 1]
    assert not duplicated, f'{len(duplicated)} duplicated, e.g. {duplicated[:5]}'
    missing = sent - set(counts)
    assert not missing, f'{len(missing)} lost, e.g. {sorted(missing)[:5]}'
    assert set(counts) == sent
    assert sum(1 for ids in per_consumer if ids) >= 2, \
        [len(ids) for ids in per_consumer]  # they really competed
    assert rows_in(db_path) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize('visibility_timeout', [None, 60.0])
def test_clean_close_without_ack_redelivers(
        tmp_path: Path, visibility_timeout: float | None) -> None:
    db_path = tmp_path / 'broker.db'
    options = {'visibility_timeout': visibility_timeout}
    with Connection(url_for(db_path), transport_options=options) as conn:
        # Routed through an exchange only the producer's connection knows:
        # the consumer must still put the message back into 'q'.
        exchange = Exchange('ax.direct', 'direct')
        Producer(conn).publish({'id': 'm1'}, exchange=exchange,
                               routing_key='k', headers={'k': 'v'},
                               declare=[Queue('q', exchange, 'k')])

    first = Connection(url_for(db_path), transport_options=options)
    message = first.SimpleQueue('q').get(timeout=5)
    assert message.payload == {'id': 'm1'}
    assert not message.delivery_info.get('redelivered')
    with Connection(url_for(db_path)) as observer:
        assert ready_count(observer, 'q') == 0  # taken, not visible
    first.close()  # no ack: kombu restores the unacked message

    with Connection(url_for(db_path), transport_options=options) as second:
        again = second.SimpleQueue('q').get(timeout=5)
        assert again.payload == {'id': 'm1'}
        assert again.headers['k'] == 'v'
        assert again.delivery_info['redelivered'] is True
        again.ack()
        assert ready_count(second, 'q') == 0
    assert rows_in(db_path) == 0


@pytest.mark.timeout(120)
def test_killed_consumer_message_returns_after_visibility_timeout(
        tmp_path: Path) -> None:
    db_path, marker = tmp_path / 'broker.db', tmp_path / 'taken'
    url = url_for(db_path)
    with Connection(url) as conn:
        Producer(conn).publish({'id': 'k1'}, routing_key='q')
    child = spawn(tmp_path, 'hang', 'take_and_hang', url, 'q', str(marker),
                  '1.0', stdin=subprocess.PIPE)
    try:
        eventually(lambda: marker.exists() and marker.read_text() == 'k1', 60,
                 'the child to take the message')
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdin.close()
    assert rows_in(db_path) == 1  # still stored, only leased

    options = {'visibility_timeout': 1.0}
    with Connection(url, transport_options=options) as conn:
        simple = conn.SimpleQueue('q')
        message = simple.get(timeout=30)  # returns once the lease expires
        assert message.payload == {'id': 'k1'}
        assert message.delivery_info['redelivered'] is True
        message.ack()
    assert rows_in(db_path) == 0


@pytest.mark.timeout(120)
def test_visibility_timeout_ack_reject_and_no_ack(tmp_path: Path) -> None:
    db_path = tmp_path / 'broker.db'
    options = {'visibility_timeout': 60.0}
    with Connection(url_for(db_path), transport_options=options) as conn:
        producer = Producer(conn)
        for n in range(3):
            producer.publish({'n': n}, routing_key='q')
        channel = conn.default_channel
        first = channel.basic_get('q')
        assert first.payload == {'n': 0}
        assert (rows_in(db_path), ready_count(conn, 'q')) == (3, 2)
        first.reject(requeue=True)  # visible again, in its old place
        assert (rows_in(db_path), ready_count(conn, 'q')) == (3, 3)
        again = channel.basic_get('q')
        assert again.payload == {'n': 0}
        assert again.delivery_info['redelivered'] is True
        again.ack()
        assert rows_in(db_path) == 2
        channel.basic_get('q').reject(requeue=False)  # n=1 dropped
        assert rows_in(db_path) == 1
        last = channel.basic_get('q', no_ack=True)  # deleted when taken
        assert last.payload == {'n': 2}
        assert rows_in(db_path) == 0
        assert channel.basic_get('q') is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize('url', ['ax+sqlite://', 'ax+sqlite:///',
                                 'ax+sqlite:////'])
def test_empty_path_is_a_clear_error(url: str) -> None:
    with pytest.raises(ValueError, match='database path is empty'):
        Connection(url).connect()


@pytest.mark.timeout(120)
@pytest.mark.parametrize('url, message', [
    ('ax+sqlite://host/x.db', 'host part'),
    ('ax+sqlite:///:memory:', 'memory'),
    ('ax+sqlite:///x.db?timeout=1', 'query strings'),
    ('ax:///x.db', 'not an ax\\+sqlite:// URL'),
])
def test_other_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Connection(url).connect()


@pytest.mark.timeout(120)
def test_relative_and_absolute_paths(tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Connection('ax+sqlite:///sub/rel.db') as conn:
        conn.connect()
        assert conn.transport.db_path == str(tmp_path / 'sub' / 'rel.db')
        assert conn.as_uri() == 'ax+sqlite:///sub/rel.db'
    assert (tmp_path / 'sub' / 'rel.db').is_file()
    absolute = tmp_path / 'abs.db'
    with Connection(f'ax+sqlite:///{absolute}') as conn:
        conn.connect()
        assert conn.transport.db_path == str(absolute)
    assert absolute.is_file()
