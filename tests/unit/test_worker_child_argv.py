"""``ax-worker --processes N``: what each child gets on its command line and in its
environment. ``--db`` and ``--broker`` (which may hold a password) go by environment:
``ps`` shows every process's argv to every user of the host. The children's real
start is in tests/integration/test_worker_processes.py."""

from __future__ import annotations

from ax_kombu.cli.worker import child_argv, child_env, main

DB = "postgresql://ax:hunter2@db.internal:5432/ax"
BROKER = "amqp://ax:hunter2@rabbit.internal:5672/ax"


def test_the_urls_are_not_on_a_childs_command_line() -> None:
    ctx = main.make_context("ax-worker", ["--processes", "2", "-Q", "high", "--db", DB,
                                          "--broker", BROKER, "-c", "high=2", "-A", "m"])
    argv = child_argv(ctx)
    assert argv == ["--queues", "high", "--app", "m", "--concurrency", "high=2"]
    assert not any("://" in arg or "hunter2" in arg for arg in argv)


def test_the_urls_are_in_a_childs_environment() -> None:
    environ = {"PATH": "/bin", "AX_DATABASE_URL": "sqlite:///old.db", "AX_NODE_ID": "w",
               "AX_WORKER_PROCESSES": "2"}
    env = child_env(environ, {"database_url": DB, "broker_url": BROKER,
                              "prefetch_multiplier": None})
    assert env == {"PATH": "/bin", "AX_DATABASE_URL": DB, "AX_BROKER_URL": BROKER}


def test_urls_not_given_as_flags_are_inherited_as_they_are() -> None:
    environ = {"AX_DATABASE_URL": DB}
    assert child_env(environ, {"database_url": None, "broker_url": None}) == environ
