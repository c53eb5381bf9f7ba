"""The housekeeper: preload, recurring jobs, dead-node recovery, periodic recovery, clock
skew, node-row pruning.

Each step below runs when due, on the housekeeper's own thread, on the
database clock (every pass re-measures it when due, see
:class:`ax_kombu.store.clock.DbClock`). The heartbeat is not one of them: it
has a thread and a connection of its own (:mod:`ax_kombu.scheduler.heart`).

* **Preload** — every ``preload_interval_ms`` (50 ms at most on a store
  without wake-ups, SQLite), at once on a producer's wake-up (PostgreSQL
  ``NOTIFY``, :class:`ax_kombu.store.notify.WakeListener`), and again straight
  away while it keeps finding full batches: this node's share of the claimable
  tasks due within ``preload_window_ms`` is *read* (nothing is written:
  :func:`ax_kombu.store.preload.preload`) and handed to the timing loop; one for
  stock Celery workers ``claim_lead_ms`` after its trigger time, so that it fires
  when due and is never staged (:mod:`ax_kombu.store.claims`). Each round reads
  ``ax_node`` for the live schedulers, which split the task ids between them;
  when they change, the node reads its new share's whole window again, as it does
  after the wheel was dropped (the node was fenced). Memory is bounded by the
  window and ``max_loaded``, never by how many future tasks exist (a round may
  overshoot ``max_loaded`` by the tasks tied at its last instant and those that
  became claimable again); no preload starts before the last one is in the
  wheel, nor while the wheel is being dropped. The same transaction reads ``ax_pause``
  (a handful of rows): paused types' and queues' tasks are not loaded, and the claimer
  refuses those loaded before (:mod:`ax_kombu.store.pauses`); when a pause is lifted
  the node reads its share's whole window again, so they are loaded at once.
* **Recurring jobs** — every ``job_interval_ms``, before the preload: the
  occurrences due within ``job_lookahead_ms`` are written as tasks
  (:mod:`ax_kombu.scheduler.recurrence`), and the preload that follows takes
  them at once. The first pass of a starting node comes before its first
  preload, so a misfire is settled before anything overdue is fired.
* **Judging** — every half ``heartbeat_interval_s`` (so a node is judged dead at most half
  an interval after its silence window ends): the clock skew is checked (a
  skew above ``clock_skew_warn_ms`` is logged once per excursion; the gauge
  always shows it), and nodes silent for ``heartbeat_misses`` intervals are
  claimed dead exactly once — but only by a node whose own beats have been
  landing for a whole window (:mod:`ax_kombu.scheduler.liveness`).
* **Strays** — every ``preload_interval_ms`` (every 250 ms for a silence window
  after a find): the other shares' claimable tasks that no live owner fires — a
  scheduler killed or paused still counts as live for its silence window, and nobody
  else reads its share until then — are taken into this node's wheel once overdue,
  and the claim decides who sends them (:mod:`ax_kombu.scheduler.strays`).
* **Recovery** — every ``recovery_interval_s``: unstarted DISPATCHING tasks
  are re-dispatched with a doubling ack timeout (bounded, never to a queue
  without consumer), and RUNNING tasks of workers not alive are retried or
  failed; the other shares' claimable tasks overdue by a silence window, however
  old, are taken too (one made claimable again for a time the strays' probe no
  longer looks at). Whatever recovery frees triggers a preload at once.
* **Pruning** (:mod:`ax_kombu.scheduler.pruning`) — every ``PRUNE_INTERVAL_MS``: the
  ``ax_node`` rows of nodes stopped longer than ``node_retention_s`` ago are deleted
  (:func:`ax_kombu.store.nodes.prune_stopped`), and the duplicate check's entries of
  tasks created longer than ``fingerprint_retention_s`` ago and already due
  (:func:`ax_kombu.store.tasks.prune_fingerprints`), one batch a pass, every second
  while there are more.
* **Due entries** (:mod:`ax_kombu.scheduler.pruning`) — every ``DUE_PRUNE_INTERVAL_MS``:
  the ``ax_due`` entries of this node's share whose time passed ``DUE_PRUNE_AFTER_MS``
  ago and whose task has moved on (:func:`ax_kombu.store.preload.prune_due`), a batch a
  pass, every second while there are more.

**A failing step stops nothing.** Each step is isolated: one that raises —
a lock or statement timeout, a lost connection, a bug — is logged with its
reason, counted in ``ax_housekeeping_errors_total{step}``, and backed off on
its own: a database error is tried again after ``STEP_BACKOFF_MS`` (so the
end of an outage costs at most that much lateness), anything else waits
``STEP_BACKOFF_MS`` doubling per failure in a row up to ``STEP_BACKOFF_MAX_MS``
(a bug is not retried in a tight loop); the other steps, the heartbeat and
the process go on. A recurring job whose row cannot be parsed is not a failing step: the
materialiser marks it broken and writes the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.config import PRIORITIES, Settings
from ax_kombu.observability import metrics
from ax_kombu.scheduler.liveness import Liveness
from ax_kombu.scheduler.loop import MAX_SLEEP_S, Loop
from ax_kombu.scheduler.pruning import DUE_PRUNE_AFTER_MS as DUE_PRUNE_AFTER_MS  # noqa: PLC0414 - re-exported
from ax_kombu.scheduler.pruning import PRUNE_INTERVAL_MS, Pruner
from ax_kombu.scheduler.recurrence import Materialiser
from ax_kombu.scheduler.strays import Strays
from ax_kombu.scheduler.timing import TimingLoop
from ax_kombu.store import Store, nodes, pauses, preload, recovery
from ax_kombu.store.notify import WakeListener

log = logging.getLogger(__name__)

#: how often a store without wake-ups (SQLite) is polled for new tasks
POLL_WITHOUT_WAKEUPS_MS = 50
#: how often ``ax_oldest_overdue_seconds`` is read from the store: a gauge scraped every
#: 15 s or so; in a burst its in-flight probe reads thousands of index entries
OVERDUE_INTERVAL_MS = 5000
#: a failed step waits this long before its next try, doubling per failure in a row ...
STEP_BACKOFF_MS = 1000
#: ... up to this
STEP_BACKOFF_MAX_MS = 30_000
#: longest the heartbeat's thread waits for the timing loop to drop the wheel when fenced
DROP_WAIT_S = 2.0
#: the steps, in the order a pass takes them
STEPS = ("jobs", "preload", "strays", "judge", "overdue", "recovery", "prune", "due")


class Housekeeper(Loop):
    """Preloads, writes recurring occurrences, judges and recovers, each when due, until
    :meth:`stop`.

    Args:
        settings: the node's settings.
        store: the task store.
        heartbeat: the node's registration (already registered when this starts).
        timing: where preloaded ids are handed; its wheel's size bounds the preload.
        info: what the heartbeat publishes about the node.
        on_fenced: called when the node learns it was declared dead.
        jobs: writes recurring jobs' occurrences as tasks.
        paused: where each preload round leaves the pauses it read, for the claimer.
    """

    def __init__(self, settings: Settings, store: Store, heartbeat: nodes.Heartbeat,
                 timing: TimingLoop, info: Callable[[], dict[str, Any]],
                 on_fenced: Callable[[], None], jobs: Materialiser,
                 paused: pauses.PauseWatch | None = None) -> None:
        super().__init__("ax-housekeeper", threading.Event())
        self._settings = settings
        self._store = store
        self._node_id = heartbeat.node_id
        self._timing = timing
        self._jobs = jobs
        self._paused = paused or pauses.PauseWatch()
        #: the stored pauses as last read, ``(kind, name)``
        self._pause_rows: frozenset[tuple[str, str]] = frozenset()
        self._strays = Strays(settings, store, timing, self._node_id, self._paused)
        self._on_fenced = on_fenced
        self.liveness = Liveness(settings, store, heartbeat, info, self._fenced, self.wake)
        self._wake_pending = True
        #: the wheel was dropped (the node was fenced): read the whole share again
        self._reread = threading.Event()
        #: how far this node has read its share of the window, and which share
        self._loaded = preload.Loaded()
        self._share = preload.Share()
        self._poll_ms = settings.preload_interval_ms
        self._listener: WakeListener | None = None
        if store.engine.dialect.name == "postgresql":
            self._listener = WakeListener(store.engine, self.wake)
        else:
            self._poll_ms = min(self._poll_ms, POLL_WITHOUT_WAKEUPS_MS)
        self._next = dict.fromkeys(STEPS, 0)
        #: failures in a row of each step that failed last time
        self._failures: dict[str, int] = {}
        self._skew_warned = False
        self._clock_steps = 0
        self._pruner = Pruner(settings, store)

    # -- control -------------------------------------------------------------------------

    def wake(self) -> None:
        """Preload now (a producer wrote a task due soon, or recovery freed some)."""
        self._wake_pending = True
        self._wake.set()

    def start(self) -> None:
        """Start the thread, then the wake-up listener (PostgreSQL)."""
        super().start()
        if self._listener is not None:
            self._listener.start()

    def stop(self) -> None:
        """Stop the listener and ask the thread to end; :meth:`join` waits for a preload
        in progress to land in the wheel."""
        if self._listener is not None:
            self._listener.stop()
        super().stop()

    def _fenced(self) -> None:
        """The node was declared dead (on the heartbeat's thread, before it registers
        anew): drop what it has loaded, wait for the drop, read it all again at the next
        preload."""
        self._on_fenced()
        deadline = time.monotonic() + DROP_WAIT_S
        while self._timing.dropping and time.monotonic() < deadline and not self.stopping:
            time.sleep(0.005)
        self._reread.set()

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping:
            timeout = self._housekeeping(self._now())
            if timeout > 0 and self._wake.wait(timeout):
                self._wake.clear()

    def _now(self) -> int:
        """Database time, re-measured when due; read locally if the database cannot be."""
        try:
            return self._store.now_ms()
        except Exception:  # the steps meet the same failure and count it
            log.debug("could not re-measure the database clock", exc_info=True)
            return int(self._store.clock.local_ms())

    def _housekeeping(self, now: int) -> float:
        """Do what is due, each step isolated; returns how long to sleep (seconds)."""
        timer = self._timing.timer
        metrics.wheel_queue_depth.labels("wheel").set(timer.wheel_depth)
        metrics.wheel_queue_depth.labels("delay").set(timer.delayed_depth)
        if now >= self._next["jobs"]:
            self._step("jobs", self._materialise, now)
        if self._preload_due(now):
            self._step("preload", self._preload, now)
        if now >= self._next["strays"]:
            self._step("strays", self._watch_strays, now)
        if now >= self._next["judge"]:
            self._check_skew()
            self._step("judge", self._judge, now)
        if now >= self._next["overdue"]:
            self._step("overdue", self._measure_overdue, now)
        if now >= self._next["recovery"]:
            self._step("recovery", self._recover, now)
        if now >= self._next["prune"]:
            self._step("prune", self._prune, now)
        if now >= self._next["due"]:
            self._step("due", self._prune_due, now)
        if self._preload_due(now) or self._next["preload"] <= now:
            return 0.001 if self._timing.incoming.items or self._timing.dropping else 0.0
        wake_at = min(self._next.values())
        return max(0.0, min((wake_at - now) / 1000.0, MAX_SLEEP_S))

    def _step(self, step: str, run: Callable[[int], None], now: int) -> None:
        """Run one step; a failure is logged, counted and backed off, never raised."""
        try:
            run(now)
        except Exception as exc:  # noqa: BLE001 - no step may stop the others (see above)
            self._failed(step, exc, now)
        else:
            self._failures.pop(step, None)

    def _failed(self, step: str, exc: BaseException, now: int) -> None:
        failures = self._failures[step] = self._failures.get(step, 0) + 1
        backoff = STEP_BACKOFF_MS  # the database's errors: it is tried again every second,
        if not isinstance(exc, SQLAlchemyError):  # so an outage's end costs ≤ 1 s of lateness
            backoff = min(STEP_BACKOFF_MS << min(failures - 1, 10), STEP_BACKOFF_MAX_MS)
        if step in self._next:
            self._next[step] = max(self._next[step], now + backoff)
        metrics.housekeeping_errors_total.labels(step).inc()
        log.warning("housekeeping step failed; backing off", exc_info=exc, extra={
            "step": step, "error": str(getattr(exc, "orig", None) or exc)[:500],
            "failures_in_a_row": failures, "retry_in_ms": backoff, "node": self._node_id})

    def _preload_due(self, now: int) -> bool:
        """The preload is due, and the last one's ids are in the wheel (``max_loaded``
        allows), and no drop of the wheel is pending."""
        if self._timing.incoming.items or self._timing.dropping:
            return False
        if self._failures.get("preload"):
            return now >= self._next["preload"]
        return self._wake_pending or now >= self._next["preload"]

    # -- the steps -----------------------------------------------------------------------

    def _materialise(self, now: int) -> None:
        """Write the recurring jobs' next occurrences as tasks; preload them at once."""
        self._next["jobs"] = now + self._settings.job_interval_ms  # after an error too
        written, more = self._jobs.run(now)
        if more:
            self._next["jobs"] = now
        if written:
            self._wake_pending = True

    def _preload(self, now: int) -> None:
        """Read the next due tasks of this node's share into memory (at most
        ``preload_batch`` a round, up to ``max_loaded``)."""
        self._wake_pending = False
        settings = self._settings
        room = min(settings.preload_batch, settings.max_loaded - len(self._timing.timer))
        if room <= 0:
            self._next["preload"] = now + self._poll_ms
            return
        horizon = now + settings.preload_window_ms
        lag = settings.claim_lead_ms  # a stock Celery worker's task fires when due, unstaged
        reread = self._reread.is_set()
        self._reread.clear()  # set again by a fence while this preload runs
        loaded = preload.Loaded() if reread else self._loaded
        try:
            with self._store.engine.begin() as conn:
                live = nodes.live_names(conn, "scheduler", now - settings.silence_ms)
                share = preload.Share.among(live, self._node_id)
                pause_rows = frozenset(pauses.read_rows(conn))
                paused = pauses.resolve(pause_rows, self._settings.queue_for, PRIORITIES)
                moved = share != self._share or paused.lifted_since(self._paused.current)
                rows, loaded = preload.preload(conn, preload.Loaded() if moved else loaded,
                                                horizon, room, share, lag, paused)
        except BaseException:
            self._wake_pending = True  # try again after the back-off
            if reread:
                self._reread.set()
            raise
        if share != self._share:
            log.info("the live schedulers changed; reading this node's new share",
                     extra={"node": self._node_id, "schedulers": share.of,
                            "share": share.part})
            self._share = share
        if pause_rows != self._pause_rows:
            self._pauses_changed(pause_rows)
        self._paused.current = paused
        self._loaded = loaded
        self._timing.hand(rows)
        metrics.preload_total.inc(len(rows))
        self._next["preload"] = now if loaded.until < horizon else now + self._poll_ms

    def _pauses_changed(self, rows: frozenset[tuple[str, str]]) -> None:
        """The stored pauses changed: log it, show it in ``ax_paused``."""
        log.info("the paused task types and queues changed", extra={
            "node": self._node_id, "paused": sorted(f"{k}:{n}" for k, n in rows)})
        for kind, name in self._pause_rows - rows:
            metrics.paused.remove(kind, name)
        for kind, name in rows:
            metrics.paused.labels(kind, name).set(1)
        self._pause_rows = rows

    def _judge(self, now: int) -> None:
        """Declare silent nodes dead and recover their tasks (if this node is trusted)."""
        self._next["judge"] = now + int(self._settings.heartbeat_interval_s * 500)
        self.liveness.judge(now)

    def _recover(self, now: int) -> None:
        self._next["recovery"] = now + int(self._settings.recovery_interval_s * 1000)
        self.liveness.recover(now)
        self._strays.backstop(now, self._share)

    def _watch_strays(self, now: int) -> None:
        """The other shares' overdue tasks (:mod:`ax_kombu.scheduler.strays`)."""
        self._next["strays"] = now + self._strays.interval_ms(now)  # after an error too
        if self._strays.watch(now, self._share):
            self._next["strays"] = now + self._strays.interval_ms(now)

    def _prune(self, now: int) -> None:
        """Old node rows and duplicate-check entries (:mod:`ax_kombu.scheduler.pruning`)."""
        self._next["prune"] = now + PRUNE_INTERVAL_MS  # after an error too
        self._next["prune"] = self._pruner.prune(now)

    def _prune_due(self, now: int) -> None:
        """Passed ``ax_due`` entries of this share (:mod:`ax_kombu.scheduler.pruning`)."""
        self._next["due"] = self._pruner.prune_due(now, self._share)

    def _measure_overdue(self, now: int) -> None:
        """``ax_oldest_overdue_seconds`` from the store: it rises even when nothing is
        published (the delay histogram then has no samples)."""
        self._next["overdue"] = now + OVERDUE_INTERVAL_MS
        with self._store.engine.connect() as conn:
            metrics.oldest_overdue.set(recovery.oldest_overdue_ms(conn, now) / 1000.0)

    def _check_skew(self) -> None:
        offset = self._store.clock.offset_ms
        metrics.clock_skew.set(offset / 1000.0)
        steps = self._store.clock.steps
        if steps > self._clock_steps:
            metrics.clock_steps_total.inc(steps - self._clock_steps)
            self._clock_steps = steps
        too_far = abs(offset) > self._settings.clock_skew_warn_ms
        if too_far and not self._skew_warned:
            log.warning("clock differs from the database clock; running on database time",
                        extra={"offset_ms": round(offset, 1)})
        self._skew_warned = too_far
