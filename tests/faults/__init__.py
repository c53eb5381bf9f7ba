"""The fault-injection suite: a real cluster under a steady load, faults, and a judge.

* :mod:`~tests.faults.cluster` — 2 schedulers and 2 workers as real daemon processes,
  whose nodes can be SIGKILLed and started again under the same name.
* :mod:`~tests.faults.producer` — the steady load, enqueued from a thread.
* :mod:`~tests.faults.fault_tasks` — the processor the workers run; it writes the ledger.
* :mod:`~tests.ledger` — the run ledger (the end-to-end tests write it too), one run per record.
* :mod:`~tests.faults.judge` — waits for the tasks to settle and judges them into a
  :mod:`~tests.faults.verdict` (the invariants, and the session's summary table).
* :mod:`~tests.faults.proxy` — a TCP proxy that cuts the daemons off PostgreSQL.
* :mod:`~tests.faults.servers` — private redis-server and RabbitMQ nodes a test may restart.
* :mod:`~tests.faults.faketime` — libfaketime on one process, its wall clock stepped mid-run.
* :mod:`~tests.faults.timing` — epoch-ms time of the test host.

The scenarios are in :mod:`~tests.faults.test_faults`.
"""
