"""A producer for the steady benchmark: RATE tasks/s, delays 0.05–30 s, for SECONDS.

    python -m bench.produce RATE SECONDS   (settings from AX_* variables); prints the count
"""

from __future__ import annotations

import random
import sys
import time

from ax_kombu.api import Client
from ax_kombu.config import from_env

TICK_S = 0.05


def main() -> None:
    rate, seconds = int(sys.argv[1]), float(sys.argv[2])
    client = Client(from_env())
    rng = random.Random(7)
    per_tick = max(1, round(rate * TICK_S))
    start = time.monotonic()
    sent = 0
    tick = 0
    while time.monotonic() - start < seconds:
        client.enqueue_many([{"task_type": "bench.steady", "payload": {"n": sent + i},
                              "delay": rng.uniform(0.05, 30.0)} for i in range(per_tick)])
        sent += per_tick
        tick += 1
        pause = start + tick * TICK_S - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    client.close()
    print(sent)


if __name__ == "__main__":
    main()
