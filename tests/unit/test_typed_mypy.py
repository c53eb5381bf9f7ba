"""mypy checks typed tasks' calls (issue 39): ``mypy --strict`` with ``ax_kombu.mypy_plugin``
finds nothing in tests/typing/typed_tasks_ok.py, and in typed_tasks_bad.py exactly one error
on each line marked ``# E: <code>``, of that code (``close.enqueue("42")`` among them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mypy import api

TYPING = Path(__file__).resolve().parents[1] / "typing"
ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")
MARK = re.compile(r"#\s*E:\s*(?P<code>[a-z-]+)")


def _mypy(tmp_path: Path, *files: Path) -> tuple[str, int]:
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nplugins = ax_kombu.mypy_plugin\nignore_missing_imports = True\n"
                      "follow_imports = silent\n"
                      "[mypy-kombu.*,amqp.*]\nfollow_imports = skip\n")
    out, err, status = api.run(["--strict", "--config-file", str(config), "--cache-dir",
                                str(tmp_path / "cache"), "--no-error-summary",
                                *map(str, files)])
    assert "INTERNAL ERROR" not in out + err, out + err
    return out, status


def _marked(path: Path) -> dict[int, str]:
    return {number: found.group("code")
            for number, line in enumerate(path.read_text().splitlines(), start=1)
            if (found := MARK.search(line))}


@pytest.mark.timeout(120)
def test_mypy_accepts_the_typed_uses_and_rejects_exactly_the_marked_lines(
        tmp_path: Path) -> None:
    good, bad = TYPING / "typed_tasks_ok.py", TYPING / "typed_tasks_bad.py"
    out, status = _mypy(tmp_path, good, bad)
    errors: dict[tuple[str, int], list[str]] = {}
    for line in out.splitlines():
        if found := ERROR.match(line):
            key = (Path(found.group("path")).name, int(found.group("line")))
            errors.setdefault(key, []).append(found.group("code"))
    assert not [k for k in errors if k[0] == good.name], out
    got = {line: codes for (name, line), codes in errors.items() if name == bad.name}
    expected = {line: [code] for line, code in _marked(bad).items()}
    assert got == expected, out
    assert status == 1
    source = bad.read_text().splitlines()
    assert 'close.enqueue("42")' in source[min(expected) - 1]
