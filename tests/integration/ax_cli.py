"""Running the real ``ax`` command from tests: the installed script next to this
interpreter (else its entry point through ``python -c``), with no ``AX_*`` setting from
the environment but those given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


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
