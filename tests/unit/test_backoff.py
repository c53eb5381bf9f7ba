from __future__ import annotations

import random

import pytest

from ax_kombu.core.backoff import Backoff, backoff_ms, ceiling_ms
from ax_kombu.exceptions import ValidationError


class Fixed:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def test_ceiling_doubles_from_base_until_the_cap() -> None:
    assert [ceiling_ms(n, 100, 1000) for n in range(7)] == [100, 200, 400, 800, 1000, 1000, 1000]


def test_ceiling_is_monotone_and_never_above_the_cap_even_for_huge_retry_counts() -> None:
    values = [ceiling_ms(n, 250, 600_000) for n in range(200)]
    assert values == sorted(values)
    assert max(values) == 600_000
    assert ceiling_ms(10**9, 1, 5) == 5


def test_cap_below_base_and_zero_base() -> None:
    assert ceiling_ms(0, 500, 100) == 100
    assert ceiling_ms(3, 0, 100) == 0


@pytest.mark.parametrize("args", [(-1, 100, 1000), (0, -1, 1000), (0, 100, -5)])
def test_negative_arguments_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        ceiling_ms(*args)


def test_jitter_stays_within_its_share_of_the_ceiling() -> None:
    rng = random.Random(42)
    for retry in range(8):
        ceiling = ceiling_ms(retry, 100, 5000)
        draws = [backoff_ms(retry, 100, 5000, rng, jitter=0.3) for _ in range(500)]
        assert all(ceiling * 0.7 - 1 <= d <= ceiling for d in draws)
        if ceiling >= 200:  # enough room to tell a spread from a constant
            assert max(draws) - min(draws) > ceiling * 0.2


def test_jitter_extremes() -> None:
    assert backoff_ms(2, 100, 5000, Fixed(0.0), jitter=0.5) == 400
    assert backoff_ms(2, 100, 5000, Fixed(0.999999), jitter=0.5) == 201
    assert backoff_ms(2, 100, 5000, Fixed(0.7), jitter=0.0) == 400
    assert 0 <= backoff_ms(2, 100, 5000, Fixed(0.999999), jitter=1.0) <= 1


def test_same_seed_same_delays() -> None:
    first = [backoff_ms(n % 5, 100, 5000, random.Random(7)) for n in range(20)]
    again = [backoff_ms(n % 5, 100, 5000, random.Random(7)) for n in range(20)]
    assert first == again


@pytest.mark.parametrize("jitter", [-0.1, 1.5])
def test_jitter_outside_zero_one_is_refused(jitter: float) -> None:
    with pytest.raises(ValueError):
        backoff_ms(0, 100, 1000, Fixed(0.5), jitter=jitter)


# --- a task type's own back-off (ax.Backoff, seconds) ---------------------------------------


def test_a_type_backoff_is_in_seconds_and_doubles_to_its_cap() -> None:
    backoff = Backoff(base=1, cap=600, jitter=0.5)
    assert [backoff.delay_ms(n, Fixed(0.0)) for n in (0, 1, 2, 9, 10, 50)] == [
        1000, 2000, 4000, 512_000, 600_000, 600_000]
    assert backoff.delay_ms(3, Fixed(0.999999)) == 4001  # at most half taken off
    assert Backoff(base=0.25, cap=1, jitter=0).delay_ms(1, Fixed(0.9)) == 500
    assert Backoff() == Backoff(base=1.0, cap=600.0, jitter=0.5)


@pytest.mark.parametrize("options", [
    {"base": -1}, {"cap": -5, "base": 0}, {"base": 10, "cap": 5}, {"jitter": -0.1},
    {"jitter": 1.5}, {"base": float("nan")}, {"cap": float("inf")}, {"base": "1"},
    {"jitter": True}, {"cap": 3651 * 86_400},
])
def test_a_bad_type_backoff_is_refused(options: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Backoff(**options)  # type: ignore[arg-type]
