"""The package's layers hold (the import-linter contracts in pyproject.toml: cli, the console
and Celery, the producer API, the daemons, node, broker | store, core; no import circles), and
a producer's ``import ax_kombu`` loads no worker code and no HTTP client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: installed with the test extra, next to this interpreter
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_the_import_contracts_are_kept() -> None:
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, check=False,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr


def test_import_ax_kombu_loads_neither_the_worker_nor_urllib3() -> None:
    check = ("import ax_kombu, sys; "
             "loaded = sorted(m for m in sys.modules "
             "if m.startswith('ax_kombu.worker') or m.split('.')[0] == 'urllib3'); "
             "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, check=False,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
