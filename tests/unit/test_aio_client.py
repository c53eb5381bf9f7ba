"""The async client's constructor does what would otherwise stall the loop on its first
call: the OpenTelemetry API's import (several ms), which every enqueue needs to read the
current trace context."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROGRAM = """
import sys
from ax_kombu.aio import AsyncClient
from ax_kombu.config import from_env
before = "opentelemetry.trace" in sys.modules
AsyncClient(from_env({}, database_url="sqlite:///DB", broker_url="ax+sqlite:///BROKER"))
print(before, "opentelemetry.trace" in sys.modules)
"""


def test_the_constructor_imports_the_tracing_api_before_any_call_on_the_loop(
        tmp_path: Path) -> None:
    program = (PROGRAM.replace("DB", str(tmp_path / "ax.sqlite3"))
               .replace("BROKER", str(tmp_path / "broker.sqlite3")))
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split() == ["False", "True"]
