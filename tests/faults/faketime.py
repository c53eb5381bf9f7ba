"""libfaketime on one process: its wall clock is stepped mid-run (as by NTP) while its
monotonic clock and every other process's clock stay true.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tests.e2e.system import REPO

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

SITECUSTOMIZE = '''\
"""Loaded by a process under libfaketime: with FAKETIME_DONT_FAKE_MONOTONIC=1,
time.sleep fails with EINVAL, so it sleeps in select() on the monotonic clock."""
import select
import time


def _sleep(seconds):
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        select.select([], [], [], remaining)


time.sleep = _sleep
'''


class Faketime:
    """The environment that puts one process under libfaketime, and the clock step.

    The process's wall clock is the real one plus what the timestamp file says
    (``+0`` at first); :meth:`step` rewrites it. Monotonic time is not faked (as in
    an NTP step).
    """

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "faketime"
        self.dir.mkdir(exist_ok=True)
        self.file = self.dir / "offset"
        self._write("+0")
        (self.dir / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def _write(self, value: str) -> None:
        tmp = self.file.with_suffix(".new")
        tmp.write_text(value + "\n")
        tmp.replace(self.file)

    def env(self, base_pythonpath: str = "") -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.dir), str(REPO), base_pythonpath) if p)
        return {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME_TIMESTAMP_FILE": str(self.file),
                "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                "PYTHONPATH": path}

    def step(self, seconds: int) -> None:
        self._write(f"{seconds:+d}s")

    def unavailable(self) -> str | None:
        """None if a Python process under libfaketime sees a stepped clock and can sleep,
        else why not."""
        import sys

        if not FAKETIME_LIB.exists():
            return f"{FAKETIME_LIB} not found (Debian package 'faketime')"
        probe = self.dir / "probe"
        probe.write_text("+10s\n")
        env = {**os.environ, **self.env(), "FAKETIME_TIMESTAMP_FILE": str(probe)}
        code = "import time; t = time.time(); time.sleep(0.01); print(t)"
        try:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                  text=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return "a Python process under libfaketime hung"
        if done.returncode != 0:
            return f"a Python process under libfaketime failed: {done.stderr.strip()[-300:]}"
        shift = float(done.stdout.strip()) - time.time()
        if not 8 < shift < 12:
            return f"libfaketime did not step the clock (+10 s asked, {shift:+.1f} s seen)"
        return None
