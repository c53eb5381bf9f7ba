"""Running the ``ax`` command from tests, with no ``AX_*`` setting from the environment but
those given.

:func:`run_ax` runs the command's click entry point in this process (click's runner): the
same code from argument parsing to exit code, one-line errors on stderr and all, without
starting an interpreter per call (over a second each on this machine, for about 150 calls).
What needs a process of its own (a signal, a run killed midway) starts the installed
script, :func:`ax_command`; so do the end-to-end tests and CI's install check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from click.testing import CliRunner


def ax_command() -> list[str]:
    """The installed ``ax`` next to this interpreter, else its entry point via ``python -c``."""
    script = Path(sys.executable).parent / "ax"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from ax_kombu.cli import main; main()"]


def run_ax(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
           answer: str | None = None) -> subprocess.CompletedProcess[str]:
    """``ax ARGS`` to its end in this process, output captured, ``env`` the only AX_* set,
    in directory ``cwd`` if given, ``answer`` on its standard input. An exception the
    command lets out is exit code 1 with its traceback on stderr, as the script's
    interpreter would show it."""
    from ax_kombu.cli import main

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("AX_")}
    with _directory(cwd):
        result = CliRunner().invoke(main, list(args), input=answer,
                                    env={**unset, **(env or {})}, prog_name="ax")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["ax", *args], result.exit_code, result.stdout, stderr)


@contextmanager
def _directory(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


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
