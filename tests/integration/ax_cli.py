"""Running the real ``ax`` command from tests: the installed script next to this
interpreter (else its entry point through ``python -c``), with no ``AX_*`` setting from
the environment but those given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def ax_command() -> list[str]:
    """The installed ``ax`` next to this interpreter, else its entry point via ``python -c``."""
    script = Path(sys.executable).parent / "ax"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from ax_kombu.cli import main; main()"]


def run_ax(*args: str, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``ax ARGS`` to its end (60 s at most), output captured, ``env`` the only AX_* set."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
    return subprocess.run([*ax_command(), *args], capture_output=True, text=True, timeout=60,
                          check=False, cwd=cwd, env={**clean, **(env or {})})


class Ax:
    """Runs ``ax ARGS`` with ``AX_DATABASE_URL`` set to this test's database."""

    def __init__(self, url: str) -> None:
        self.env = {"AX_DATABASE_URL": url}

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_ax(*args, env=self.env)

    def ok(self, *args: str) -> str:
        """The output of a run that must succeed."""
        proc = self(*args)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def json(self, *args: str) -> Any:
        """The ``--json`` output of a run that must succeed."""
        return json.loads(self.ok(*args, "--json"))

    def fails(self, code: int, *args: str) -> str:
        """The one ``ax: error: …`` line of a run that must exit ``code``, printing nothing."""
        proc = self(*args)
        lines = proc.stderr.splitlines()
        assert proc.returncode == code, (proc.returncode, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("ax: error: "), proc.stderr
        assert proc.stdout == ""
        return lines[0]
