"""Everything between ax and the message broker, all through Kombu.

* :mod:`~ax_kombu.broker.messages` — the wire format of a task message;
* :mod:`~ax_kombu.broker.publisher` — connections, queues, and the batched publisher;
* :mod:`~ax_kombu.broker.redis_pull` — the worker's batched receive on Redis;
* :mod:`~ax_kombu.broker.sqlite` — the server-free ``ax+sqlite://`` Kombu transport.
"""
