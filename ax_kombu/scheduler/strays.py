"""Strays: the other shares' tasks nobody fires, taken into this node's wheel.

The live schedulers split the claimable tasks between them by id
(:class:`ax_kombu.store.preload.Share`), and a scheduler killed, paused or unable to
preload still counts as live for its silence window (``heartbeat_misses ×
heartbeat_interval_s``, 3 s by default): until then nobody else reads its share. Its
tasks are not left to wait for that window. A scheduler looks, on the housekeeper's
thread, for the claimable tasks of the *other* shares that are overdue
(:func:`ax_kombu.store.preload.overdue_elsewhere`) and hands them to its timing loop;
the claim, a compare-and-set, decides who sends each, so a task two schedulers have loaded is
still dispatched once per attempt.

* **Watched** every ``preload_interval_ms``: the tasks due within the last two silence
  windows and overdue by more than a preload interval plus ``claim_lead_ms``. A live
  owner has fired every task of its share by then (it reads what became claimable
  within one preload interval, and fires ``claim_lead_ms`` early), so while every owner
  keeps up this finds nothing. (From two silence windows back only: parked tasks are
  READY in the same index range, and are walked from there on, not from the beginning.)
* **Eagerly** for a silence window after some were found (an owner is not keeping up):
  every :data:`EAGER_STRAYS_MS`, those overdue by that much. A killed scheduler's first
  task is at most about two preload intervals late, the next ones about
  ``2 × EAGER_STRAYS_MS``.
* **The backstop**, every ``recovery_interval_s`` (:meth:`Strays.backstop`): those
  overdue by a silence window, however old (one made claimable again for a time the
  watch no longer looks at).
"""

from __future__ import annotations

import logging

from ax_kombu.config import Settings
from ax_kombu.observability import metrics
from ax_kombu.scheduler.timing import TimingLoop
from ax_kombu.store import Store, preload
from ax_kombu.store.pauses import PauseWatch

log = logging.getLogger(__name__)

#: once another share's tasks were found overdue: how often strays are looked for, and
#: how overdue they are taken (lateness of a dead owner's tasks against three index
#: probes a round that find nothing while every owner keeps up)
EAGER_STRAYS_MS = 250


class Strays:
    """Looks for the other shares' overdue tasks and hands them to ``timing``.

    Args:
        settings: preload interval, claim lead, silence window, ``preload_batch``,
            ``max_loaded``.
        store: the task store.
        timing: where the strays are handed.
        node_id: this node's name (for the log).
        paused: the pauses the last preload round read: their tasks are no strays.
    """

    def __init__(self, settings: Settings, store: Store, timing: TimingLoop,
                 node_id: str, paused: PauseWatch | None = None) -> None:
        self._settings = settings
        self._paused = paused or PauseWatch()
        self._store = store
        self._timing = timing
        self._node_id = node_id
        #: another share's task overdue by this much has no live owner firing it
        self._after_ms = settings.preload_interval_ms + settings.claim_lead_ms
        #: database time until which strays are looked for eagerly (some were found)
        self._eager_until = 0

    def interval_ms(self, now: int) -> int:
        """How long after ``now`` to watch again (eagerly after a find)."""
        return EAGER_STRAYS_MS if now < self._eager_until else self._settings.preload_interval_ms

    def watch(self, now: int, share: preload.Share) -> int:
        """Take the other shares' recent overdue tasks (see the module docstring); returns
        how many."""
        eager = now < self._eager_until
        after_ms = EAGER_STRAYS_MS if eager else self._after_ms
        found = self._take(now, now - 2 * self._settings.silence_ms, after_ms, share,
                           quiet=eager)
        if found:
            self._eager_until = now + self._settings.silence_ms
        return found

    def backstop(self, now: int, share: preload.Share) -> int:
        """Take the other shares' tasks overdue by a silence window, however old."""
        return self._take(now, 0, self._settings.silence_ms, share, quiet=False)

    def _take(self, now: int, since: int, after_ms: int, share: preload.Share,
              quiet: bool) -> int:
        settings = self._settings
        room = min(settings.preload_batch, settings.max_loaded - len(self._timing.timer))
        if room <= 0 or share.of <= 1 or self._timing.dropping:
            return 0
        with self._store.engine.begin() as conn:
            strays = preload.overdue_elsewhere(conn, now - after_ms, share, room,
                                                settings.claim_lead_ms, since,
                                                self._paused.current)
        if strays:
            log.log(logging.INFO if quiet else logging.WARNING,
                    "took tasks of another scheduler's share that were overdue",
                    extra={"node": self._node_id, "tasks": len(strays), "overdue_ms": after_ms})
            metrics.recovered_total.labels("stray").inc(len(strays))
            self._timing.hand(strays)
        return len(strays)
