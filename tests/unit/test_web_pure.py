"""The console's pure parts: the lateness buckets and their SVG lines
(ax_kombu.web.charts), and who may in (ax_kombu.web.security)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ax_kombu.exceptions import ConfigurationError
from ax_kombu.web import charts
from ax_kombu.web.security import Keys, check_bind

NOW = 10_000_000


def test_lateness_buckets_by_start_time_with_nearest_rank_percentiles() -> None:
    last = NOW - 5_000  # in the last 10 s bucket
    pairs = [(last - late, last) for late in range(1, 101)]  # 1..100 ms late
    pairs.append((NOW - 3_000_000, NOW - 2_999_000))  # 1 s late, 50 min ago
    pairs.append((NOW - 4_000_000, NOW - 3_700_000))  # started before the window: left out
    got = charts.lateness(pairs, NOW)
    assert len(got.p50_ms) == charts.WINDOW_MS // charts.BUCKET_MS == 360
    assert (got.p50_ms[-1], got.p99_ms[-1]) == (50, 99)
    assert got.started_per_s[-1] == 10.0  # 100 starts in 10 s
    assert got.p50_ms[60] == 1000 and got.p99_ms[60] == 1000
    assert got.starts == 101
    assert sum(v is not None for v in got.p50_ms) == 2


def test_early_start_counts_as_on_time() -> None:
    assert charts.lateness([(NOW - 100, NOW - 200)], NOW).p99_ms[-1] == 0


def test_an_empty_bucket_breaks_the_line_and_a_lone_value_still_shows() -> None:
    lines = charts.polyline([None, 1.0, None, 2.0, 4.0], charts.top([1.0, 2.0, 4.0]))
    assert len(lines) == 2
    assert all(len(line.split()) == 2 for line in lines)
    assert lines[1].endswith(f"{charts.WIDTH:.1f},0.0")  # the largest value touches the top
    assert charts.polyline([None, None], 1) == []
    assert charts.top([None, 0.0]) == 1


@pytest.mark.parametrize("bind", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(bind: str) -> None:
    check_bind(bind, None)


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_any_other_address_needs_the_token(bind: str) -> None:
    with pytest.raises(ConfigurationError, match="AX_WEB_TOKEN"):
        check_bind(bind, None)
    check_bind(bind, "t0ken")


def test_keys_accept_the_cookie_or_the_bearer_and_nothing_else() -> None:
    keys = Keys("t0ken")
    assert keys.allowed(keys.session, None)
    assert keys.allowed(None, "Bearer t0ken") and keys.allowed(None, "bearer t0ken")
    assert not keys.allowed("t0ken", None)  # the cookie holds an HMAC, never the token
    assert not keys.allowed(None, "Bearer t0ke") and not keys.allowed(None, "Basic t0ken")
    assert not keys.allowed(None, None)
    assert Keys(None).allowed(None, None)
    assert keys.csrf_ok(keys.csrf) and not keys.csrf_ok(Keys("t0ken").csrf)
    assert not keys.csrf_ok(None) and not keys.csrf_ok("")


def test_without_the_web_extra_ax_web_says_what_to_install_in_one_line() -> None:
    blocked = ("import sys; sys.modules['starlette'] = None; from ax_kombu.cli import main; "
               "main(['web'], prog_name='ax')")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        ("ax: error: ax web needs starlette, which is not installed: "
         "pip install 'ax_kombu[web]'")]
