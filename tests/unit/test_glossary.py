"""The glossary (docs/architecture.md, "Glossary") holds in the code: a retired word appears
only where the glossary allows it.

Each retired word once named several things at once; a new use would bring the confusion back.
The check reads every Python module, template and static file under ``ax_kombu/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ax_kombu"
GLOSSARY = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

#: retired word → the package paths (relative, as a prefix) where it may still appear
RETIRED: dict[str, tuple[str, ...]] = {
    r"(?i)\b(un)?held\b": (),
    r"\bHeld[A-Z]\w*|\b\w+_held\b|\bheld_\w+|\b\w+Held\b": ("config.py",),
    r"\bHolds\b|\bholdable\b": (),
    r"(?i)\badopt\w*": (),
    # the Celery hand-off's module may be named where it is wired in
    r"\bHandOff\b|(?<!celery\.)\bhandoff\b|\bhand_offs?\b": ("celery/",),
    r"~parked": (),
    r"\blast_run_node\b": ("views.py",),
    r"(?i)\bnode_lease": ("config.py",),
    r"(?i)\bmax_held\b": ("config.py",),
}

ALWAYS_ALLOWED = ("store/migrations/",)


def _files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*")
                  if p.is_file() and p.suffix in (".py", ".html", ".js", ".css", ".mako"))


def _offences(pattern: str, allowed: tuple[str, ...]) -> list[str]:
    found = []
    word = re.compile(pattern)
    for path in _files():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALWAYS_ALLOWED + allowed):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if word.search(line):
                found.append(f"ax_kombu/{rel}:{number}: {line.strip()}")
    return found


@pytest.mark.parametrize("pattern", sorted(RETIRED))
def test_a_retired_word_appears_only_where_the_glossary_allows_it(pattern: str) -> None:
    offences = _offences(pattern, RETIRED[pattern])
    assert not offences, "retired word (see docs/architecture.md, Glossary):\n" + "\n".join(offences)


def test_the_check_finds_a_retired_word_where_it_is_not_allowed() -> None:
    line = "    self.held = 0"
    assert any(re.search(p, line) for p in RETIRED)
    assert not any(re.search(p, "    self.unacked = 0") for p in RETIRED)


def test_the_glossary_lists_every_retired_word() -> None:
    text = GLOSSARY.read_text(encoding="utf-8")
    assert "## Glossary" in text
    for word in ("held", "adopt", "HandOff", "~parked", "last_run_node", "node_lease", "max_held"):
        assert word in text.split("## Glossary", 1)[1], word
