"""Recurring jobs become tasks here: the scheduler's materialiser.

Every ``job_interval_ms`` (on the housekeeper's thread, before the preload) each
scheduler takes the active jobs whose next occurrence falls within
``job_lookahead_ms`` (locked, :func:`ax_kombu.store.jobs.due_jobs`) and writes
their occurrences up to that horizon as ordinary tasks — each with the job's
name and its occurrence time (``job``, ``scheduled_at``) and triggering at that
time — then moves the job's ``next_fire_at`` past them, in one transaction. The
preload takes them into the wheel straight away, so they fire on time like any
other task.

Why an occurrence cannot run twice, or be lost:

* **One task per (job, occurrence)**: the unique ``(job, scheduled_at)`` index;
  an occurrence written twice (two schedulers, a retry after a lost commit
  reply) is one row. From there on it is a task: exactly-once dispatch per
  attempt, at-least-once execution (:mod:`ax_kombu.scheduler.node`).
* **None lost**: ``next_fire_at`` moves in the same transaction that writes the
  occurrences before it; a crash before the commit leaves both as they were.

**Broken jobs.** A job row this scheduler cannot plan — a zone its tzdata lacks, an
expression, interval or policy written past :func:`ax.schedule`'s checks — is marked
broken with the reason (``ax_job.broken``, shown by ``ax jobs list``) in the pass that
found it, and skipped; it is due again only once ``schedule()`` sets it anew. The other
jobs of the pass are written as usual.

**Misfires.** A job found behind — its ``next_fire_at`` more than
``ON_TIME_MS`` in the past: every scheduler was down (longer than the
lookahead), or the job was paused — goes by its misfire policy
(:func:`ax_kombu.core.cron.plan`): ``fire_once`` runs the latest missed
occurrence now, once; ``skip`` runs none; ``fire_all`` runs each, oldest first,
at most ``misfire_max``. Occurrences written before the outage and still not
dispatched count as missed too; those the policy drops are CANCELLED with the
reason. A scheduler makes this pass before its first preload, and in that first pass
waits for the jobs another scheduler is planning instead of skipping them, so a
restarted cluster settles every misfire before anything overdue is fired (two
schedulers restarted together: one plans a job and cancels its pre-written missed
occurrence, while the other, having skipped the locked job, claimed that occurrence and
ran it — a second run for ``fire_once``).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, Row

from ax_kombu.config import Settings
from ax_kombu.core import cron
from ax_kombu.core.ids import ReservedIds
from ax_kombu.core.values import STRATEGIES
from ax_kombu.exceptions import ValidationError
from ax_kombu.observability import metrics
from ax_kombu.store import Store
from ax_kombu.store import jobs as job_store
from ax_kombu.store.tasks import wake_schedulers

log = logging.getLogger(__name__)

#: an occurrence first seen later than this after its time was missed, not merely late:
#: above the pass interval (a job created just before its first occurrence is first seen
#: up to one pass late) with room for a housekeeper slowed by a large preload
ON_TIME_MS = 1000
#: most jobs handled per pass (the next pass, at once, takes the rest)
JOB_BATCH = 500
#: most occurrences one job writes per pass
PER_JOB = 1000


class Materialiser:
    """Writes the occurrences of recurring jobs as tasks, a pass at a time.

    Args:
        settings: the scheduler's settings (lookahead, interval, ``misfire_max``).
        store: the task store.
        ids: where task ids come from.
    """

    def __init__(self, settings: Settings, store: Store, ids: ReservedIds,
                 node_id: str = "") -> None:
        self._settings = settings
        self._store = store
        self._ids = ids
        self._node_id = node_id
        self._schedules: dict[tuple[Any, ...], cron.Schedule] = {}
        #: a first pass has completed (it waited for the jobs other schedulers were planning)
        self._settled = False

    def run(self, now_ms: int) -> tuple[int, bool]:
        """One pass at database time ``now_ms``.

        Returns:
            How many tasks were written, and whether jobs are left for another pass now.
        """
        horizon = now_ms + self._settings.job_lookahead_ms
        self._ids.next_ids(0)  # renew the id lease now, not inside the transaction below
        with self._store.engine.begin() as conn:
            # the first pass waits for jobs another scheduler is planning (not skips them):
            # its misfire decision is then settled before this scheduler's first preload
            due = job_store.due_jobs(conn, horizon, JOB_BATCH, wait=not self._settled)
            if not due:
                self._settled = True
                return 0, False
            rows: list[dict[str, Any]] = []
            for job in due:
                rows += self._job(conn, job, now_ms, horizon)
            created = job_store.insert_occurrences(conn, rows)
            first = min((r["trigger_time"] for r in rows), default=None)
            if first is not None and first < now_ms + self._settings.preload_window_ms:
                wake_schedulers(conn, first)
        self._settled = True
        metrics.job_occurrences_total.inc(len(created))
        return len(created), len(due) == JOB_BATCH

    def _job(self, conn: Connection, job: Row[Any], now_ms: int,
             horizon: int) -> list[dict[str, Any]]:
        """Plan one job, cancel what its misfire policy drops, move ``next_fire_at``;
        returns the task rows to write (none for a job marked broken here)."""
        try:
            schedule = self._schedule(job)
        except Exception as exc:  # noqa: BLE001 - pure code on the row: the row is at fault
            self._mark_broken(conn, job, exc)
            return []
        pending: list[tuple[int, int]] = []
        if job.next_fire_at < now_ms - ON_TIME_MS:  # behind: what was written and not sent?
            pending = job_store.pending_occurrences(
                conn, job.name, self._written_since(schedule, job.next_fire_at),
                now_ms - ON_TIME_MS)
        try:
            plan = cron.plan(schedule, job.next_fire_at, now_ms, horizon, misfire=job.misfire,
                             grace_ms=job.misfire_grace_ms,
                             misfire_max=self._settings.misfire_max, on_time_ms=ON_TIME_MS,
                             pending=[p[1] for p in pending], limit=PER_JOB)
        except Exception as exc:  # noqa: BLE001 - as above
            self._mark_broken(conn, job, exc)
            return []
        if plan.missed:
            self._misfired(conn, job, plan, {at: task_id for task_id, at in pending},
                           now_ms)
        job_store.update_job(conn, job.name, {"next_fire_at": plan.next_fire_at})
        ids = self._ids.next_ids(len(plan.create))
        return [job_store.occurrence_row(job, task_id, scheduled_at, trigger, now_ms)
                for task_id, (scheduled_at, trigger) in zip(ids, plan.create, strict=True)]

    def _written_since(self, schedule: cron.Schedule, next_fire_at: int) -> int:
        """The earliest occurrence a pass can have written ahead that may still wait: within
        twice the lookahead before ``next_fire_at``, or the one occurrence before that
        (a job slower than the lookahead has one written at a time). Older undispatched
        occurrences are not the outage's (a queue without workers keeps its own)."""
        low = next_fire_at - 2 * self._settings.job_lookahead_ms
        before = schedule.last_before(low + 1)
        return before if before is not None else low

    def _misfired(self, conn: Connection, job: Row[Any], plan: cron.Plan,
                  pending: dict[int, int], now_ms: int) -> None:
        """Cancel the written occurrences the policy drops, move the kept ones to the pass."""
        reason = (f"misfire: occurrence missed while no scheduler ran job {job.name!r}; "
                  f"dropped by its policy {job.misfire!r}")
        cancelled = job_store.cancel_occurrences(
            conn, [pending[at] for at in plan.cancel], now_ms, reason)
        job_store.retrigger(conn, [(pending[at], trigger) for at, trigger in plan.retrigger])
        caught_up = len(plan.retrigger) + sum(1 for at, trigger in plan.create if trigger != at)
        metrics.job_misfires_total.labels("run").inc(caught_up)
        metrics.job_misfires_total.labels("dropped").inc(max(0, plan.missed - caught_up))
        log.warning("recurring job missed occurrences; applying its misfire policy",
                    extra={"job": job.name, "policy": job.misfire, "missed": plan.missed,
                           "catch_up_runs": caught_up, "cancelled": len(cancelled),
                           "behind_ms": now_ms - job.next_fire_at})

    def _schedule(self, job: Row[Any]) -> cron.Schedule:
        """The job's schedule, its row checked as :func:`ax.schedule` checks its input.

        Raises:
            ValidationError: the row cannot be planned (e.g. a zone this machine's tzdata
                lacks, an interval out of range, an unknown misfire policy or strategy).
        """
        key = (job.cron, job.every_ms, job.tz, job.anchor_ms, job.misfire, job.strategy)
        found = self._schedules.get(key)
        if found is not None:
            return found
        check_row(job)
        found = cron.make_schedule(job.cron, job.every_ms, job.tz, job.anchor_ms)
        if len(self._schedules) > 10_000:
            self._schedules.clear()
        self._schedules[key] = found
        return found

    def _mark_broken(self, conn: Connection, job: Row[Any], error: Exception) -> None:
        """Mark ``job`` broken with the reason, in this pass's transaction."""
        detail = str(error) if isinstance(error, ValidationError) else repr(error)
        where = f" (scheduler {self._node_id})" if self._node_id else ""
        reason = f"cannot be planned{where}: {detail}"
        job_store.mark_broken(conn, job.name, reason)
        log.error("recurring job cannot be planned; marked broken until schedule() sets "
                  "it again", extra={"job": job.name, "error": detail})


def check_row(job: Row[Any]) -> None:
    """What :func:`ax_kombu.recurring.build_job` checks and the zone/expression check of
    :func:`ax_kombu.core.cron.make_schedule` cannot see in a stored row.

    Raises:
        ValidationError: the first thing wrong with the row.
    """
    if job.every_ms is not None and not cron.MIN_EVERY_MS <= job.every_ms <= cron.MAX_EVERY_MS:
        raise ValidationError(f"every must be between 1 second and 3650 days, got "
                              f"{job.every_ms} ms")
    if job.misfire not in cron.MISFIRE_POLICIES:
        raise ValidationError(f"unknown misfire policy {job.misfire!r}")
    if job.strategy not in STRATEGIES:
        raise ValidationError(f"unknown strategy {job.strategy!r}")
