from __future__ import annotations

import random
import time
from collections.abc import Hashable

import pytest

from ax_kombu.core.delay_queue import DelayQueue
from ax_kombu.core.wheel import DEFAULT_LEVEL_SIZES, TimingWheel, TriggerTimer

START = 1_000_000
DAY_MS = 86_400_000


def _span(level_sizes: tuple[int, ...]) -> int:
    span = 1
    for size in level_sizes:
        span *= size
    return span


def _round_up(due_ms: int, start_ms: int, tick_ms: int) -> int:
    return start_ms + -((start_ms - due_ms) // tick_ms) * tick_ms


def test_default_span_covers_at_least_a_minute() -> None:
    wheel: TimingWheel[int] = TimingWheel(START)
    assert _span(DEFAULT_LEVEL_SIZES) >= 60_000
    assert wheel.horizon_ms == START + _span(DEFAULT_LEVEL_SIZES) - 1
    assert wheel.current_ms == START
    assert len(wheel) == 0 and wheel.next_due_ms() is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_due_times_fire_in_order_exactly_once_never_early_or_late(seed: int) -> None:
    rng = random.Random(seed)
    wheel: TimingWheel[int] = TimingWheel(START)
    due = {key: START + rng.randint(1, 200_000) for key in range(3_000)}
    for key, due_ms in due.items():
        wheel.add(key, due_ms)
    fired: list[int] = []
    previous = START
    while len(wheel):
        now = previous + rng.randint(1, 3_000)
        batch = wheel.advance(now)
        for key in batch:
            assert previous < due[key] <= now  # not early, not late
        fired.extend(batch)
        previous = now
    assert sorted(fired) == sorted(due)  # each key exactly once
    assert fired == sorted(due, key=lambda k: (due[k], k))  # due order, ties by insertion


def test_every_delta_in_a_small_wheel_fires_on_its_exact_tick() -> None:
    sizes = (2, 3, 4)
    wheel: TimingWheel[int] = TimingWheel(0, level_sizes=sizes)
    assert wheel.horizon_ms == _span(sizes) - 1
    for delta in range(1, _span(sizes)):
        wheel.add(delta, delta)
    for now in range(1, _span(sizes)):
        assert wheel.next_due_ms() == now
        assert wheel.advance(now) == [now]
    assert len(wheel) == 0 and wheel.next_due_ms() is None


def test_keys_in_levels_two_and_three_cascade_and_fire_exactly_on_time() -> None:
    wheel: TimingWheel[str] = TimingWheel(START)
    edge = _span(DEFAULT_LEVEL_SIZES) - 1
    offsets = [511, 512, 513, 1_000, 32_767, 32_768, 32_769, 100_000, 1_500_000, edge]
    for offset in offsets:
        wheel.add(f"k{offset}", START + offset)
    for offset in offsets:
        assert wheel.advance(START + offset - 1) == []
        assert wheel.next_due_ms() == START + offset
        assert wheel.advance(START + offset) == [f"k{offset}"]
    assert len(wheel) == 0


def test_level_boundary_and_span_edge() -> None:
    wheel: TimingWheel[str] = TimingWheel(START)
    wheel.add("boundary", START + 512)
    wheel.add("edge", wheel.horizon_ms)
    with pytest.raises(ValueError):
        wheel.add("beyond", wheel.horizon_ms + 1)
    assert "beyond" not in wheel and len(wheel) == 2
    assert wheel.advance(START + 511) == []
    assert wheel.advance(START + 512) == ["boundary"]
    edge = START + _span(DEFAULT_LEVEL_SIZES) - 1
    assert wheel.advance(edge - 1) == []
    assert wheel.advance(edge) == ["edge"]


def test_horizon_moves_with_the_clock_and_rejection_keeps_old_schedule() -> None:
    wheel: TimingWheel[str] = TimingWheel(0, level_sizes=(4, 4))
    assert wheel.horizon_ms == 15
    wheel.add("a", 5)
    with pytest.raises(ValueError):
        wheel.add("a", 16)
    assert wheel.next_due_ms() == 5  # the rejected reschedule left "a" alone
    wheel.advance(10)
    assert wheel.horizon_ms == 25
    wheel.add("b", 25)
    assert wheel.advance(25) == ["b"]


def test_removed_keys_never_fire() -> None:
    wheel: TimingWheel[int] = TimingWheel(START)
    for key in range(100):
        wheel.add(key, START + key * 997 % 70_000 + 1)
    removed = set(range(0, 100, 3))
    for key in removed:
        assert wheel.remove(key) is True
        assert key not in wheel
    assert wheel.remove(0) is False
    assert wheel.remove(12_345) is False
    assert len(wheel) == 100 - len(removed)
    fired = wheel.advance(START + 70_000)
    assert set(fired) == set(range(100)) - removed


def test_readding_a_key_reschedules_it() -> None:
    wheel: TimingWheel[str] = TimingWheel(START)
    wheel.add("a", START + 100)
    wheel.add("b", START + 50)
    wheel.add("a", START + 10)
    assert len(wheel) == 2
    assert wheel.next_due_ms() == START + 10
    assert wheel.advance(START + 10) == ["a"]
    wheel.add("b", START + 70_000)  # moved from level 0 to level 2
    assert wheel.advance(START + 69_999) == []
    assert wheel.advance(START + 70_000) == ["b"]


def test_due_in_the_past_fires_on_the_next_advance() -> None:
    wheel: TimingWheel[str] = TimingWheel(START)
    wheel.advance(START + 500)
    wheel.add("now", START + 500)
    wheel.add("past", START + 10)
    wheel.add("ancient", 0)
    assert len(wheel) == 3 and "past" in wheel
    assert wheel.next_due_ms() == 0
    assert wheel.advance(START + 500) == ["ancient", "past", "now"]
    assert wheel.advance(START + 501) == []


def test_clock_going_backwards_is_treated_as_no_time_passing() -> None:
    wheel: TimingWheel[str] = TimingWheel(START)
    wheel.add("a", START + 20)
    wheel.advance(START + 10)
    assert wheel.advance(START) == []
    assert wheel.current_ms == START + 10
    assert wheel.advance(START + 20) == ["a"]


def test_ties_fire_in_insertion_order_even_across_levels() -> None:
    wheel: TimingWheel[str] = TimingWheel(0)
    wheel.add("first", 600)  # level 1 at t=0
    wheel.advance(500)
    wheel.add("second", 600)  # level 0 at t=500
    wheel.add("third", 600)
    assert wheel.advance(600) == ["first", "second", "third"]


def test_coarse_ticks_round_up_so_nothing_fires_early() -> None:
    wheel: TimingWheel[str] = TimingWheel(START, tick_ms=10)
    assert wheel.horizon_ms == START + (_span(DEFAULT_LEVEL_SIZES) - 1) * 10
    wheel.add("b", START + 20)
    wheel.add("a", START + 15)
    wheel.add("c", START + 5_121)
    assert wheel.next_due_ms() == START + 20
    assert wheel.advance(START + 15) == []
    assert wheel.advance(START + 19) == []
    assert wheel.advance(START + 20) == ["a", "b"]  # same tick, still due order
    wheel.add("d", START + 21)  # mid-tick: rounds up to the next tick end
    assert wheel.advance(START + 29) == []
    assert wheel.advance(START + 30) == ["d"]
    assert wheel.advance(START + 5_129) == []
    assert wheel.advance(START + 5_130) == ["c"]


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError):
        TimingWheel(0, tick_ms=0)
    with pytest.raises(ValueError):
        TimingWheel(0, level_sizes=())
    with pytest.raises(ValueError):
        TimingWheel(0, level_sizes=(64, 1))


def test_unorderable_keys_with_equal_due_times() -> None:
    keys = [object() for _ in range(5)]
    timer: TriggerTimer[object] = TriggerTimer(0, level_sizes=(4, 4))
    for key in keys:
        timer.add(key, 100)  # delay queue: heap must never compare keys
    for key in keys:
        timer.add(key, 10)
    assert timer.advance(100) == keys


def test_long_gap_skips_empty_slots_cheaply() -> None:
    wheel: TimingWheel[int] = TimingWheel(START)
    wheel.add(1, START + 2_000_000)
    began = time.perf_counter()
    assert wheel.advance(START + 1_999_999) == []
    assert wheel.advance(START + 2_000_000) == [1]
    timer: TriggerTimer[int] = TriggerTimer(START)
    for key in range(3):
        timer.add(key, START + (key + 1) * 10 * DAY_MS + key)
    assert timer.advance(START + 40 * DAY_MS) == [0, 1, 2]
    # A loop over every elapsed tick would need billions of iterations here.
    assert time.perf_counter() - began < 1.0


def test_delay_queue_pops_strictly_before_the_limit_in_order() -> None:
    queue: DelayQueue[str] = DelayQueue()
    queue.add("c", 30)
    queue.add("a", 10)
    queue.add("b", 20)
    queue.add("b2", 20)
    assert len(queue) == 4 and queue.peek_ms() == 10
    assert queue.remove("a") is True
    assert queue.remove("a") is False
    assert "a" not in queue and queue.peek_ms() == 20
    queue.add("c", 5)  # reschedule: the old heap entry goes stale
    assert queue.pop_due_before(20) == [("c", 5)]
    assert queue.pop_due_before(30) == [("b", 20), ("b2", 20)]
    assert queue.pop_due_before(1_000) == []
    assert len(queue) == 0 and queue.peek_ms() is None


def test_delay_queue_stays_correct_through_heavy_churn() -> None:
    queue: DelayQueue[int] = DelayQueue()
    for round_ in range(50):
        for key in range(100):
            queue.add(key, 1_000 - key + round_)
    for key in range(0, 100, 2):
        queue.remove(key)
    assert len(queue._heap) <= 2 * len(queue) + 65  # stale entries get compacted
    popped = queue.pop_due_before(10_000)
    assert popped == sorted(((k, 1_049 - k) for k in range(1, 100, 2)), key=lambda e: e[1])


def test_trigger_timer_sends_far_keys_to_the_delay_queue_and_fires_them_on_time() -> None:
    timer: TriggerTimer[str] = TriggerTimer(START)
    due = {"near": START + 1_000, "day": START + DAY_MS + 7, "week": START + 7 * DAY_MS}
    for key, due_ms in due.items():
        timer.add(key, due_ms)
    assert (timer.wheel_depth, timer.delayed_depth, len(timer)) == (1, 2, 3)
    assert "week" in timer and timer.next_due_ms() == START + 1_000
    now = START
    fired: dict[str, int] = {}
    for step in [3_600_000] * 23 + [3_599_999, 8, 3_600_000 - 7] + [3_600_000] * 200:
        previous, now = now, now + step
        for key in timer.advance(now):
            fired[key] = now
            assert previous < due[key] <= now
    assert fired == {"near": START + 3_600_000, "day": due["day"], "week": due["week"]}
    assert len(timer) == 0 and timer.next_due_ms() is None


def test_trigger_timer_removes_and_reschedules_across_layers() -> None:
    timer: TriggerTimer[str] = TriggerTimer(0, level_sizes=(8, 8))
    timer.add("a", 1_000)
    timer.add("b", 10)
    assert timer.remove("a") is True and timer.remove("a") is False
    timer.add("b", 500)  # wheel -> delay queue
    assert (timer.wheel_depth, timer.delayed_depth) == (0, 1)
    timer.add("b", 20)  # delay queue -> wheel
    assert (timer.wheel_depth, timer.delayed_depth) == (1, 0)
    assert timer.advance(10_000) == ["b"]


def test_add_earlier_keeps_the_earlier_time_in_either_layer() -> None:
    """The timing loop's add: a later time handed over for a key already loaded (an
    out-of-date ``ax_due`` entry) never delays it; an earlier one moves it, across layers too."""
    timer: TriggerTimer[str] = TriggerTimer(0, level_sizes=(8, 8))
    timer.add_earlier("a", 40)
    timer.add_earlier("a", 900)  # later: kept at 40
    timer.add_earlier("b", 900)  # in the delay queue
    assert (timer.due_ms("a"), timer.due_ms("b"), timer.due_ms("c")) == (40, 900, None)
    timer.add_earlier("b", 30)  # earlier: delay queue -> wheel
    assert (timer.wheel_depth, timer.delayed_depth) == (2, 0)
    timer.add_earlier("b", 35)
    assert timer.advance(39) == ["b"] and timer.advance(10_000) == ["a"]
    timer.add_earlier("a", 20_000)  # fired: scheduled afresh
    assert timer.due_ms("a") == 20_000


def test_trigger_timer_next_due_rounds_delayed_keys_up_to_their_tick() -> None:
    timer: TriggerTimer[str] = TriggerTimer(0, tick_ms=10, level_sizes=(4, 4))
    timer.add("far", 1_005)
    assert timer.delayed_depth == 1
    assert timer.next_due_ms() == 1_010
    assert timer.advance(1_009) == []
    assert timer.advance(1_010) == ["far"]


class _Model:
    """Reference: a plain dict, sorted on every advance."""

    def __init__(self, start_ms: int, tick_ms: int) -> None:
        self.start, self.tick, self.now, self.seq = start_ms, tick_ms, start_ms, 0
        self.keys: dict[int, tuple[int, int, int]] = {}  # key -> (due, seq, fire_ms)

    def add(self, key: int, due_ms: int) -> None:
        fire = due_ms if due_ms <= self.now else _round_up(due_ms, self.start, self.tick)
        self.keys[key] = (due_ms, self.seq, fire)
        self.seq += 1

    def advance(self, now_ms: int) -> list[int]:
        self.now = max(self.now, now_ms)
        fired = [k for k, e in self.keys.items() if e[2] <= self.now]
        fired.sort(key=lambda k: self.keys[k][:2])
        for key in fired:
            del self.keys[key]
        return fired

    def next_due(self) -> int | None:
        return min((e[2] for e in self.keys.values()), default=None)


def _run_against_model(
    timer: TimingWheel[int] | TriggerTimer[int], model: _Model, seed: int, far_ms: int
) -> None:
    rng = random.Random(seed)
    for _ in range(3_000):
        op = rng.random()
        key = rng.randrange(60)
        if op < 0.45:
            due = model.now + rng.choice([rng.randint(-30, 40), rng.randint(-5, far_ms)])
            if isinstance(timer, TimingWheel) and due > timer.horizon_ms:
                with pytest.raises(ValueError):
                    timer.add(key, due)
                continue
            timer.add(key, due)
            model.add(key, due)
        elif op < 0.6:
            assert timer.remove(key) is (model.keys.pop(key, None) is not None)
        else:
            now = model.now + rng.choice([0, 1, rng.randint(-3, 20), rng.randint(0, far_ms)])
            assert timer.advance(now) == model.advance(now)
        assert len(timer) == len(model.keys)
        assert (key in timer) is (key in model.keys)
        assert timer.next_due_ms() == model.next_due()


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
@pytest.mark.parametrize("tick_ms", [1, 3])
@pytest.mark.parametrize("sizes", [(4, 4, 4), (8, 2), (512, 64, 64)])
def test_wheel_matches_sorted_model(seed: int, tick_ms: int, sizes: tuple[int, ...]) -> None:
    wheel: TimingWheel[int] = TimingWheel(START, tick_ms, sizes)
    far = min(_span(sizes) * tick_ms, 5_000)
    _run_against_model(wheel, _Model(START, tick_ms), seed, far)


@pytest.mark.parametrize("seed", [21, 22, 23, 24])
@pytest.mark.parametrize("tick_ms", [1, 7])
@pytest.mark.parametrize("sizes", [(4, 4), (2, 2, 2), (16, 8, 4)])
def test_trigger_timer_matches_sorted_model(
    seed: int, tick_ms: int, sizes: tuple[int, ...]
) -> None:
    timer: TriggerTimer[int] = TriggerTimer(START, tick_ms, sizes)
    _run_against_model(timer, _Model(START, tick_ms), seed, _span(sizes) * tick_ms * 6)
    assert timer.wheel_depth + timer.delayed_depth == len(timer)


def test_keys_of_any_hashable_type() -> None:
    wheel: TimingWheel[Hashable] = TimingWheel(0)
    wheel.add(("task", 1), 5)
    wheel.add("task-2", 5)
    wheel.add(3, 4)
    assert wheel.advance(5) == [3, ("task", 1), "task-2"]


def test_a_crowded_higher_slot_keeps_its_next_due_time_as_keys_leave() -> None:
    """Many keys due at one instant beyond level 0 (a burst, claimed in batches): the next due
    time stays theirs while any is left, then moves to the next tick of the slot; keys that
    come back at an earlier tick take over."""
    wheel: TimingWheel[int] = TimingWheel(START, 1, (8, 8, 8))
    burst, later = START + 100, START + 103  # both in one level-2 slot (ticks 64..127)
    for key in range(1_000):
        wheel.add(key, burst)
    for key in range(1_000, 1_010):
        wheel.add(key, later)
    for first in range(0, 990, 110):
        for key in range(first, first + 110):
            wheel.remove(key)
        assert wheel.next_due_ms() == burst
    for key in range(990, 1_000):
        wheel.remove(key)
    assert wheel.next_due_ms() == later
    wheel.add(7, START + 98)  # back, earlier than what is left
    assert wheel.next_due_ms() == START + 98
    assert wheel.advance(START + 200) == [7, *range(1_000, 1_010)]
    assert wheel.next_due_ms() is None


@pytest.mark.parametrize("seed", [31, 32, 33])
@pytest.mark.parametrize(("tick_ms", "sizes"), [(1, (8, 4)), (3, (4, 4)), (1, (256, 32))])
def test_add_earlier_many_is_add_earlier_in_turn(
    seed: int, tick_ms: int, sizes: tuple[int, ...]
) -> None:
    """The timing loop's batch add against the one-key add, on twin timers: batches in due
    order or not, one due time for all or not, with repeated keys, keys scheduled in
    either layer, overdue and far keys; cancels and advances in between."""
    rng = random.Random(seed)
    one: TriggerTimer[int] = TriggerTimer(START, tick_ms, sizes)
    many: TriggerTimer[int] = TriggerTimer(START, tick_ms, sizes)
    far = _span(sizes) * tick_ms * 3
    now = START
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            pairs = [(rng.randrange(50), now + rng.choice([rng.randint(-5, 30), rng.randint(1, far)]))
                     for _ in range(rng.randint(0, 25))]
            if pairs and rng.random() < 0.3:
                pairs = [(key, pairs[0][1]) for key, _ in pairs]
            if rng.random() < 0.5:
                pairs.sort(key=lambda pair: pair[1])
            for key, due in pairs:
                one.add_earlier(key, due)
            many.add_earlier_many(pairs)
        elif op < 0.55:
            key = rng.randrange(50)
            assert one.remove(key) is many.remove(key)
        else:
            now += rng.choice([0, 1, rng.randint(1, 20), rng.randint(1, far)])
            assert many.advance(now) == one.advance(now)
        assert many.next_due_ms() == one.next_due_ms()
        assert (many.wheel_depth, many.delayed_depth) == (one.wheel_depth, one.delayed_depth)
        assert all(many.due_ms(key) == one.due_ms(key) for key in range(50))


def test_a_burst_in_one_millisecond_fires_there_in_insertion_order() -> None:
    """100,000 ids due at one instant, in batches as the preload hands them over, a tenth
    cancelled: the rest fire at that millisecond, not before, in the order they came."""
    timer: TriggerTimer[int] = TriggerTimer(START, level_sizes=(256, 32))
    due = START + 5_000  # beyond level 0: the burst cascades once
    ids = list(range(100_000))
    for first in range(0, len(ids), 2_000):
        timer.add_earlier_many([(task_id, due) for task_id in ids[first:first + 2_000]])
    for task_id in ids[::10]:
        assert timer.remove(task_id)
    assert timer.next_due_ms() == due and len(timer) == 90_000
    assert all(timer.advance(now) == [] for now in range(START, due))
    assert timer.advance(due) == [task_id for task_id in ids if task_id % 10]
    assert len(timer) == 0 and timer.next_due_ms() is None


@pytest.mark.parametrize("due", [START + 100, START + 5_000])  # level 0, then level 1
def test_a_tick_its_cancels_emptied_fires_nothing_and_takes_keys_again(due: int) -> None:
    """A cancel leaves an emptied tick filed: the next due time skips it, a pass through it
    fires nothing, and a key added there again (one by one or in a batch) makes it due."""
    timer: TriggerTimer[int] = TriggerTimer(START, level_sizes=(256, 32))
    timer.add_earlier_many([(1, due), (2, due), (3, due + 7)])
    assert timer.next_due_ms() == due
    assert timer.remove(1) and timer.remove(2) and not timer.remove(2)
    assert timer.next_due_ms() == due + 7 and len(timer) == 1 and timer.wheel_depth == 1
    timer.add_earlier_many([(4, due), (5, due)])  # back into the emptied tick, in a batch
    assert timer.next_due_ms() == due and timer.due_ms(4) == due
    assert timer.remove(4) and timer.remove(5)
    timer.add(6, due)  # and one by one
    assert timer.next_due_ms() == due
    assert timer.remove(6) and timer.next_due_ms() == due + 7
    assert timer.advance(due) == [] and timer.next_due_ms() == due + 7
    assert timer.advance(due + 7) == [3] and len(timer) == 0 and timer.next_due_ms() is None


def test_a_key_cancelled_and_added_again_to_its_tick_fires_once_in_its_new_place() -> None:
    wheel: TimingWheel[str] = TimingWheel(START, level_sizes=(16, 4))
    for key in "abc":
        wheel.add(key, START + 40)  # level 1: cascades before it fires
    assert wheel.remove("a")
    wheel.add("d", START + 40)
    wheel.add("a", START + 40)
    assert wheel.advance(START + 39) == []
    assert wheel.advance(START + 40) == ["b", "c", "d", "a"]
    assert len(wheel) == 0


def test_cancelling_the_earliest_overdue_key_moves_the_next_due_time() -> None:
    wheel: TimingWheel[str] = TimingWheel(START)
    wheel.advance(START + 100)
    wheel.add("late", START + 10)
    wheel.add("later", START + 20)
    wheel.add("future", START + 300)
    assert wheel.next_due_ms() == START + 10
    assert wheel.remove("late") and wheel.next_due_ms() == START + 20
    assert wheel.remove("later") and wheel.next_due_ms() == START + 300
    assert wheel.advance(START + 101) == [] and wheel.advance(START + 300) == ["future"]


def test_consecutive_ticks_across_laps_of_level_zero_fire_one_by_one() -> None:
    """1 ms passes over keys on every tick for three laps of an 8-slot level 0: each pass
    fires its own tick's keys, including the ticks where a lap ends and a slot cascades."""
    wheel: TimingWheel[int] = TimingWheel(START, level_sizes=(8, 4, 2))
    for key in range(1, 25):
        wheel.add(key, START + key)
    assert [wheel.advance(START + now) for now in range(1, 25)] == [[key] for key in range(1, 25)]
    assert wheel.next_due_ms() is None
