"""The quiet flags of a worker (:class:`ax_kombu.worker.quiet.Quiet`): a signal's quiet is
kept until a beat has stored it, the row's ``quiet_at`` decides otherwise; and
:func:`~ax_kombu.worker.quiet.hush` takes nothing more from the broker."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from ax_kombu.store.nodes import Heartbeat
from ax_kombu.worker.intake import Intake
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.quiet import Quiet, hush
from ax_kombu.worker.shutdown import Shutdown


def _quiet() -> tuple[Quiet, Any]:
    beat = SimpleNamespace(ask_quiet=False, quiet_at=None)
    return Quiet(cast(Intake, None), cast(Shutdown, None), "w0"), beat


def _beat(quiet: Quiet, beat: Any, stored: int | None, landed: bool = True) -> bool:
    """One beat: what it carried (``ask_quiet``), the row's ``quiet_at`` read back."""
    hb = cast(Heartbeat, beat)
    quiet.before_beat(hb)
    carried = bool(beat.ask_quiet)
    if landed:
        beat.quiet_at = stored
    quiet.after_beat(hb, landed)
    return carried


def test_a_signal_is_quiet_at_once_and_stored_by_the_next_beat() -> None:
    quiet, beat = _quiet()
    quiet.request()
    assert quiet.wanted
    assert _beat(quiet, beat, stored=1000) and quiet.wanted
    assert not _beat(quiet, beat, stored=1000) and quiet.wanted  # stored: not asked again
    assert not _beat(quiet, beat, stored=None) and not quiet.wanted  # resumed by the row


def test_a_signal_during_a_beat_is_not_undone_by_that_beat() -> None:
    quiet, beat = _quiet()
    quiet.before_beat(cast(Heartbeat, beat))
    quiet.request()  # after the beat was sent without it
    beat.quiet_at = None
    quiet.after_beat(cast(Heartbeat, beat), True)
    assert quiet.wanted
    assert _beat(quiet, beat, stored=2000) and quiet.wanted


def test_a_failed_beat_keeps_the_signal_for_the_next() -> None:
    quiet, beat = _quiet()
    quiet.request()
    assert _beat(quiet, beat, stored=None, landed=False) and quiet.wanted
    assert _beat(quiet, beat, stored=3000) and quiet.wanted


def test_the_row_alone_quiets_and_resumes() -> None:
    quiet, beat = _quiet()
    assert not _beat(quiet, beat, stored=5) and quiet.wanted
    assert not _beat(quiet, beat, stored=None) and not quiet.wanted


class _Consumer:
    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


def test_hush_cancels_consumers_and_gives_a_puller_no_room() -> None:
    limits: list[int] = []
    pulled = SimpleNamespace(pulled=limits.append, prefetch=7, consumer=None, consuming=True)
    kombu = SimpleNamespace(pulled=None, consumer=_Consumer(), consuming=True, prefetch=3)
    idle = SimpleNamespace(pulled=None, consumer=_Consumer(), consuming=False, prefetch=0)
    hush(cast(list[Lane], [pulled, kombu, idle]))
    assert limits == [0] and pulled.prefetch == 0
    assert kombu.consumer.cancelled == 1 and not kombu.consuming
    assert idle.consumer.cancelled == 0
