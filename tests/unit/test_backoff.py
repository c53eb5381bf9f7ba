from __future__ import annotations

import random

import pytest

from ax_kombu.core.backoff import backoff_ms, ceiling_ms


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
