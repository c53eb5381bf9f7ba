"""A plain Kombu consumer that drains the three priority queues until told to stop.

    python -m bench.drain SECONDS   (settings from AX_* variables)
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kombu import Consumer

from ax_kombu.broker.connection import connection, task_queues
from ax_kombu.config import from_env


def main() -> None:
    settings = from_env()
    stop_at = time.monotonic() + float(sys.argv[1])
    count = 0
    with connection(settings) as conn:
        def on_message(_body: Any, message: Any) -> None:
            nonlocal count
            count += 1
            message.ack()

        queues = list(task_queues(settings).values())
        with Consumer(conn, queues=queues, callbacks=[on_message], accept=["json"]) as consumer:
            consumer.qos(prefetch_count=1000)
            while time.monotonic() < stop_at:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
    print(count)


if __name__ == "__main__":
    main()
