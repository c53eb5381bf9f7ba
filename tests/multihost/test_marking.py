"""The multi-host step's own guard: its tests are marked, so the main suite leaves them out."""

from __future__ import annotations

import pytest


def test_tests_here_carry_the_multihost_marker(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("multihost") is not None
