"""Everything between ax and the message broker, all through Kombu.

* :mod:`~ax_kombu.broker.messages` — the wire format of a task message;
* :mod:`~ax_kombu.broker.publisher` — the batched publisher;
* :mod:`~ax_kombu.broker.redis_pull` — the worker's batched receive on Redis;
* :mod:`~ax_kombu.broker.sqlite` — the server-free ``ax+sqlite://`` Kombu transport;
* :mod:`~ax_kombu.broker.sqlite_store` — that transport's SQLite file: URL, schema, statements;
* :mod:`~ax_kombu.broker.connection` — connections, queues, and the start-up broker URL check.
"""
