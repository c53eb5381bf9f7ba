"""core.gating.decide, pure: order keys, limits, discard and cover, and their combinations.

The store (``ax_kombu.store.gates``) computes :class:`Running` — heads of keys, active
counts, unfinished occurrences — and these tests hand ``decide`` such views directly.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ax_kombu.core.gating import SERIAL_PREFIX, Candidate, Decision, Running, decide

PROPERTY = settings(max_examples=400, deadline=None)


def task(task_id: int, trigger: int = 0, task_type: str = "t", *, gate: str | None = None,
         key: str | None = None, job: str | None = None,
         at: int | None = None) -> Candidate:
    return Candidate(task_id, task_type, trigger, gate, key, job, at)


def ordered(task_id: int, key: str, trigger: int = 0, task_type: str = "t",
            gate: str = "order") -> Candidate:
    return task(task_id, trigger, task_type, gate=gate, key=key)


def occurrence(task_id: int, job: str, at: int, gate: str, task_type: str = "t") -> Candidate:
    """An occurrence of ``job`` scheduled (and triggered) at ``at``."""
    return task(task_id, at, task_type, gate=gate, job=job, at=at)


def ids(pairs: list[tuple[int, str]]) -> list[int]:
    return [task_id for task_id, _ in pairs]


# -- nothing to gate -------------------------------------------------------------------------


def test_no_candidates_decide_nothing() -> None:
    assert decide([], Running()) == Decision()


def test_candidates_without_gate_or_limit_all_start_in_trigger_order() -> None:
    d = decide([task(3, 20), task(1, 10), task(2, 10)], Running())
    assert d == Decision(start=[1, 2, 3])


# -- order keys --------------------------------------------------------------------------------


def test_a_busy_key_makes_its_task_wait() -> None:
    d = decide([ordered(1, "k")], Running(busy_keys=frozenset({"k"}), heads={"k": 1}))
    assert (d.start, d.wait) == ([], [1])


def test_only_the_head_of_a_key_starts() -> None:
    cands = [ordered(1, "k", 10), ordered(2, "k", 20), ordered(3, "k", 30)]
    d = decide(cands, Running(heads={"k": 2}))  # e.g. 1 was retried ahead of its place
    assert (d.start, d.wait) == ([2], [1, 3])


def test_a_head_that_is_not_due_holds_its_key() -> None:
    """hold_failed: the head waits for its retry (not a candidate); the rest wait for it."""
    d = decide([ordered(2, "k", 10), ordered(3, "k", 20)], Running(heads={"k": 1}))
    assert (d.start, d.wait) == ([], [2, 3])


def test_two_of_one_key_in_a_batch_first_starts_second_waits() -> None:
    cands = [ordered(2, "k", 10), ordered(1, "k", 10)]
    assert (decide(cands, Running(heads={"k": 1})).start,
            decide(cands, Running(heads={"k": 1})).wait) == ([1], [2])
    # without a head in the view the first (trigger, id) starts and makes the key busy
    d = decide(cands, Running())
    assert (d.start, d.wait) == ([1], [2])


def test_different_keys_all_start() -> None:
    cands = [ordered(i, f"k{i}", trigger=i) for i in range(5)]
    d = decide(cands, Running(heads={f"k{i}": i for i in range(5)}))
    assert d.start == [0, 1, 2, 3, 4] and d.wait == []


def test_order_skip_follows_the_heads_the_store_computes() -> None:
    """skip_failed: the store leaves a retrying task out of ``heads``; decide obeys heads."""
    retried = ordered(1, "k", 50, gate="order_skip")
    nxt = ordered(2, "k", 20, gate="order_skip")
    d = decide([retried, nxt], Running(heads={"k": 2}))
    assert (d.start, d.wait) == ([2], [1])
    d = decide([retried], Running(heads={}))  # nothing else waits: the retry starts
    assert d.start == [1]


def test_a_key_counts_only_with_an_order_gate() -> None:
    cands = [task(1, 0, key="k"), task(2, 1, key="k")]  # no gate: the key is not an order
    assert decide(cands, Running(busy_keys=frozenset({"k"}), heads={"k": 9})).start == [1, 2]


def test_serial_job_occurrences_share_their_key() -> None:
    key = SERIAL_PREFIX + "nightly"
    cands = [task(5, 100, gate="order", key=key, job="nightly", at=100),
             task(6, 200, gate="order", key=key, job="nightly", at=200)]
    d = decide(cands, Running(heads={key: 5}))
    assert (d.start, d.wait) == ([5], [6])
    d = decide(cands, Running(busy_keys=frozenset({key}), heads={key: 5}))
    assert (d.start, d.wait) == ([], [5, 6])


# -- limits ------------------------------------------------------------------------------------


def test_limit_room_is_limit_minus_active_and_the_rest_wait_in_trigger_order() -> None:
    cands = [task(7, 30), task(4, 10), task(9, 10), task(2, 20), task(3, 10), task(1, 40)]
    d = decide(cands, Running(limits={"t": 3}, active={"t": 1}))
    assert d.start == [3, 4]  # trigger 10, ties by id
    assert d.wait == [9, 2, 7, 1]


def test_a_type_at_or_over_its_limit_starts_nothing() -> None:
    cands = [task(1), task(2)]
    assert decide(cands, Running(limits={"t": 2}, active={"t": 2})).wait == [1, 2]
    assert decide(cands, Running(limits={"t": 2}, active={"t": 5})).wait == [1, 2]  # lowered


def test_limits_are_per_type() -> None:
    cands = [task(1, 0, "a"), task(2, 1, "a"), task(3, 2, "b"), task(4, 3, "c")]
    d = decide(cands, Running(limits={"a": 1, "b": 1}, active={"b": 1}))
    assert d.start == [1, 4] and d.wait == [2, 3]


# -- discard -----------------------------------------------------------------------------------


def test_discard_cancels_an_occurrence_while_an_earlier_one_is_unfinished() -> None:
    new = occurrence(11, "report", 200, "discard")
    d = decide([new], Running(unfinished={"report": [(10, 100), (11, 200)]}))
    assert d.start == [] and ids(d.cancel) == [11]
    reason = d.cancel[0][1]
    assert "'report'" in reason and "10" in reason and "discard" in reason


def test_discard_ignores_later_occurrences_and_other_jobs() -> None:
    new = occurrence(11, "report", 200, "discard")
    d = decide([new], Running(unfinished={"report": [(11, 200), (12, 300)],
                                          "other": [(1, 50)]}))
    assert d.start == [11] and d.cancel == []


def test_two_discard_occurrences_in_one_batch_first_starts_second_is_cancelled() -> None:
    a, b = occurrence(21, "sync", 100, "discard"), occurrence(22, "sync", 200, "discard")
    for unfinished in ({"sync": [(21, 100), (22, 200)]}, {}):  # with or without the store's view
        d = decide([b, a], Running(unfinished=unfinished))
        assert d.start == [21] and ids(d.cancel) == [22]
        assert "21" in d.cancel[0][1] and "'sync'" in d.cancel[0][1]


def test_a_discard_occurrence_over_its_limit_waits_rather_than_cancels() -> None:
    new = occurrence(11, "report", 200, "discard")
    d = decide([new], Running(limits={"t": 1}, active={"t": 1},
                              unfinished={"report": [(10, 100), (11, 200)]}))
    assert d.wait == [11] and d.cancel == []


# -- cover -------------------------------------------------------------------------------------


def test_cover_supersedes_earlier_unfinished_occurrences_and_starts() -> None:
    new = occurrence(12, "feed", 300, "cover")
    running = Running(unfinished={"feed": [(10, 100), (11, 200), (12, 300), (13, 400)]})
    d = decide([new], running)
    assert d.start == [12]
    assert ids(d.supersede) == [10, 11]  # 13 is later: left alone
    for _, reason in d.supersede:
        assert "12" in reason and "'feed'" in reason and "superseded" in reason


def test_cover_in_one_batch_the_later_occurrence_replaces_the_one_started_before_it() -> None:
    a, b = occurrence(21, "feed", 100, "cover"), occurrence(22, "feed", 200, "cover")
    d = decide([a, b], Running(unfinished={"feed": [(21, 100), (22, 200)]}))
    assert d.start == [22] and ids(d.supersede) == [21]
    assert "22" in d.supersede[0][1]


def test_cover_three_in_one_batch_each_superseded_once() -> None:
    occ = [occurrence(30 + i, "feed", 100 * i, "cover") for i in range(1, 4)]
    d = decide(occ, Running(unfinished={"feed": [(o.task_id, o.scheduled_at or 0) for o in occ]}))
    assert d.start == [33] and ids(d.supersede) == [31, 32]


def test_cover_keeps_the_limit_accounting_right_after_superseding_in_the_batch() -> None:
    a, b = occurrence(21, "feed", 100, "cover"), occurrence(22, "feed", 200, "cover")
    others = [task(40, 300), task(41, 400)]
    running = Running(limits={"t": 2}, unfinished={"feed": [(21, 100), (22, 200)]})
    d = decide([a, b, *others], running)
    # 21 started then gave its slot back when 22 superseded it: 22 and 40 fill the two slots
    assert d.start == [22, 40] and d.wait == [41] and ids(d.supersede) == [21]


def test_cover_supersedes_a_running_occurrence_without_freeing_its_slot() -> None:
    """The running one is signalled, and still counts until it ends."""
    new = occurrence(12, "feed", 300, "cover")
    d = decide([new, task(50, 400)], Running(limits={"t": 2}, active={"t": 1},
                                             unfinished={"feed": [(10, 100), (12, 300)]}))
    assert d.start == [12] and d.wait == [50] and ids(d.supersede) == [10]


def test_cover_skips_an_earlier_occurrence_that_triggers_later_in_the_batch() -> None:
    """An earlier occurrence waiting for a retry triggers after a later one: it is superseded
    before its turn and never started."""
    retry = task(10, 500, gate="cover", job="feed", at=100)
    new = occurrence(11, "feed", 200, "cover")
    d = decide([retry, new], Running(unfinished={"feed": [(10, 100), (11, 200)]}))
    assert d.start == [11] and ids(d.supersede) == [10] and d.wait == []


# -- combinations ------------------------------------------------------------------------------


def test_limit_and_keys_together() -> None:
    cands = [ordered(1, "a", 10), ordered(2, "a", 20), ordered(3, "b", 30),
             ordered(4, "c", 40), task(5, 50)]
    d = decide(cands, Running(limits={"t": 2}, heads={"a": 1, "b": 3, "c": 4}))
    assert d.start == [1, 3]
    assert d.wait == [2, 4, 5]


def test_a_head_waiting_for_the_limit_keeps_its_key_free_for_nobody_else() -> None:
    cands = [ordered(1, "a", 10), ordered(2, "a", 20)]
    d = decide(cands, Running(limits={"t": 1}, active={"t": 1}, heads={"a": 1}))
    assert d.start == [] and d.wait == [1, 2]


def test_keys_are_checked_before_the_limit_so_a_waiting_key_takes_no_slot() -> None:
    cands = [ordered(1, "a", 10), task(2, 20)]
    d = decide(cands, Running(limits={"t": 1}, busy_keys=frozenset({"a"}), heads={"a": 1}))
    assert d.start == [2] and d.wait == [1]


# -- property ----------------------------------------------------------------------------------

TYPES = ("t0", "t1", "t2")
KEYS = ("k0", "k1", "k2")
JOBS = ("j0", "j1", "j2")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Candidate], Running]:
    """Candidates as the store would hand them: a job has one strategy and one type; the
    store's ``unfinished`` includes the job's candidates (they are waiting) and maybe others;
    a key's head is one of its candidates or a task not due."""
    job_kind = {j: (draw(st.sampled_from(("discard", "cover", "serial"))),
                    draw(st.sampled_from(TYPES))) for j in JOBS}
    n = draw(st.integers(0, 14))
    cands: list[Candidate] = []
    for task_id in range(1, n + 1):
        trigger = draw(st.integers(0, 6))
        kind = draw(st.sampled_from(("plain", "order", "job")))
        task_type = draw(st.sampled_from(TYPES))
        if kind == "plain":
            cands.append(task(task_id, trigger, task_type))
        elif kind == "order":
            cands.append(ordered(task_id, draw(st.sampled_from(KEYS)), trigger, task_type,
                                 draw(st.sampled_from(("order", "order_skip")))))
        else:
            job = draw(st.sampled_from(JOBS))
            strategy, job_type = job_kind[job]
            at = trigger * 100 + task_id  # distinct per job, in trigger order
            if strategy == "serial":
                cands.append(task(task_id, trigger, job_type, gate="order",
                                  key=SERIAL_PREFIX + job, job=job, at=at))
            else:
                cands.append(task(task_id, trigger, job_type, gate=strategy, job=job, at=at))
    limits = draw(st.dictionaries(st.sampled_from(TYPES), st.integers(1, 4)))
    active = draw(st.dictionaries(st.sampled_from(TYPES), st.integers(0, 5)))
    keys = {c.order_key for c in cands if c.order_key is not None}
    busy = frozenset(k for k in sorted(keys) if draw(st.booleans()))
    heads: dict[str, int] = {}
    for key in sorted(keys):
        mine = [c.task_id for c in cands if c.order_key == key]
        choice = draw(st.sampled_from([*mine, 1000, None]))
        if choice is not None:
            heads[key] = choice
    unfinished: dict[str, list[tuple[int, int]]] = {}
    for c in cands:
        if c.job is not None:
            unfinished.setdefault(c.job, []).append((c.task_id, c.scheduled_at or 0))
    for job in JOBS:
        extra = draw(st.lists(st.integers(0, 800), max_size=2))
        unfinished.setdefault(job, []).extend((2000 + i * 10 + JOBS.index(job), at)
                                              for i, at in enumerate(extra))
    return cands, Running(limits, active, busy, heads, unfinished)


@PROPERTY
@given(scenarios())
def test_decisions_respect_limits_keys_and_account_for_every_candidate(
        scenario: tuple[list[Candidate], Running]) -> None:
    cands, running = scenario
    d = decide(cands, running)
    by_id = {c.task_id: c for c in cands}
    started = [by_id[i] for i in d.start]
    # limits: never more started than the room left
    per_type = Counter(c.task_type for c in started)
    for task_type, limit in running.limits.items():
        assert per_type[task_type] <= max(0, limit - running.active.get(task_type, 0))
    # keys: never two per key, none on a busy key, only heads
    keyed = [c for c in started if c.gate in ("order", "order_skip") and c.order_key]
    assert len({c.order_key for c in keyed}) == len(keyed)
    for c in keyed:
        assert c.order_key not in running.busy_keys
        assert running.heads.get(c.order_key or "", c.task_id) == c.task_id
    # jobs: at most one started occurrence per discard or cover job
    jobs = Counter(c.job for c in started if c.gate in ("discard", "cover"))
    assert all(n == 1 for n in jobs.values())
    # every candidate in exactly one of start / wait / cancel / superseded
    superseded = ids(d.supersede)
    assert len(superseded) == len(set(superseded))
    groups = [d.start, d.wait, ids(d.cancel), [i for i in superseded if i in by_id]]
    seen = Counter(i for group in groups for i in group)
    assert set(seen) == set(by_id) and all(n == 1 for n in seen.values()), (d, seen)
    # superseding touches only earlier unfinished occurrences of a cover job
    for task_id, _ in d.supersede:
        assert any(task_id == t for occ in running.unfinished.values() for t, _ in occ)


@pytest.mark.parametrize("seed_order", [(1, 2, 3), (3, 2, 1), (2, 3, 1)])
def test_decide_does_not_depend_on_the_order_candidates_are_given(
        seed_order: tuple[int, int, int]) -> None:
    base = {1: ordered(1, "k", 10), 2: task(2, 10), 3: ordered(3, "k", 5)}
    d = decide([base[i] for i in seed_order], Running(limits={"t": 2}, heads={"k": 3}))
    assert d.start == [3, 2] and d.wait == [1]


def test_an_earlier_occurrence_waiting_for_its_limit_is_not_also_superseded() -> None:
    old = occurrence(1, "feed", 100, "cover", task_type="old")
    new = occurrence(2, "feed", 200, "cover", task_type="new")
    d = decide([old, new], Running(limits={"old": 1}, active={"old": 1},
                                   unfinished={"feed": [(1, 100), (2, 200)]}))
    assert d.start == [2] and ids(d.supersede) == [1]
    assert d.wait == []
