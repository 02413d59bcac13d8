"""The reconciler: drive ``outcome_unknown`` and abandoned ``in_progress`` to the truth.

It leases due operations in batches, asks the provider, and applies the evidence. It never
guesses a money outcome: what it cannot prove stays ``outcome_unknown`` and, after enough
checks or age, is flagged ``needs_attention`` for a human.
"""

from __future__ import annotations

import contextvars
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from ..core import State, backoff_delay
from ..errors import ConfigurationError, CorruptRecord, StaleVersion
from ..execution._executor import RetryPolicy, owner_of_this_process
from ..observing import _logs as logs
from ..observing import _metrics as metrics
from ..observing import _tracing as tracing
from ..outcome import Decision, settled
from ..provider import (
    AnswerKind,
    Capability,
    Provider,
    StatusQuery,
    can_query_status,
    can_void,
    capabilities_of,
)
from ..records import OperationRecord, Redactor
from ..routing import Proof
from ..storage._store import Store
from ._cross_flags import cross_flag_open
from ._crossings import CrossCheck
from ._fallbacks import attempt_age, fall_over, past_window
from ._policy import DEFAULT_CONCURRENCY, ReconcileReport, ReconcilerPolicy
from ._resends import resend_if_covered
from ._voids import VOID_REQUESTED, VOID_WANTED, query_of, run_void, void_due

__all__ = ["ReconcileReport", "Reconciler", "ReconcilerPolicy"]


_PAST_DEADLINE = "unknown past the policy's void deadline: release the authorisation"


def _pool_size(store: Store) -> int | None:
    """The store's pooled connections (a QueuePool's size), or None if it does not pool."""
    size = getattr(store.engine.pool, "size", None)
    return int(size()) if callable(size) else None


def _check_bound(provider: Provider) -> timedelta:
    """One check's worst case on ``provider``: three calls (a lookup by metadata, a read by
    reference, a re-submission) and a second to spare."""
    return provider.max_call_duration * 3 + timedelta(seconds=1)


class Reconciler:
    def __init__(
        self,
        *,
        store: Store,
        providers: Iterable[Provider],
        policy: ReconcilerPolicy | None = None,
        owner: str | None = None,
        submit_retry: RetryPolicy | None = None,
        rand: Callable[[], float] = random.random,
        tenant_ids: Collection[str] | None = None,
        crossings: CrossCheck | None = None,
    ) -> None:
        self.store = store
        self.providers = {p.name: p for p in providers}
        # No policy: one whose lease covers a check on the slowest adapter (at least 60 s).
        self.policy = policy or ReconcilerPolicy(
            lease=max([ReconcilerPolicy().lease, *map(_check_bound, self.providers.values())])
        )
        self.owner = owner or owner_of_this_process(self, "reconciler")
        self.submit_retry = submit_retry or RetryPolicy(max_attempts=1)
        # A routed operation's earlier providers, asked after each of its checks; without
        # one given, duplicates found are voided where the provider can, else flagged.
        self.crossings = crossings or CrossCheck(
            store=store, providers=self.providers, owner=self.owner
        )
        self._rand = rand
        # None: every tenant. A set: only those (a daemon per shard, or the demo's own).
        self.tenant_ids = frozenset(tenant_ids) if tenant_ids is not None else None
        pool = _pool_size(store)
        wanted = self.policy.concurrency
        if wanted is not None and pool is not None and wanted > pool:
            raise ConfigurationError(
                f"reconciler concurrency {wanted} exceeds the store's pool of {pool} "
                "connections; lower the concurrency or raise the pool size"
            )
        self.concurrency = wanted or min(DEFAULT_CONCURRENCY, pool or DEFAULT_CONCURRENCY)
        # The longest one check may take: a check whose claimed lease has less than this
        # left when it starts (it queued behind others) renews its lease first.
        self.check_bound = self.policy.lease
        bounds = [_check_bound(p) for p in self.providers.values()]
        if bounds:
            self.check_bound = max(bounds)
        for p in self.providers.values():
            # A check may cost three calls: a lookup by metadata, a read by reference, and
            # a re-submission. The lease must cover them all.
            needed = _check_bound(p)
            if self.policy.lease < needed:
                raise ConfigurationError(
                    f"reconciler lease {self.policy.lease.total_seconds():g}s cannot cover "
                    f"one check on {p.name!r} ({needed.total_seconds():g}s: three calls of "
                    f"{p.max_call_duration.total_seconds():g}s); raise the lease"
                )

    # -- one pass ---------------------------------------------------------------------

    def reconcile_once(
        self,
        stop: threading.Event | None = None,
        progress: Callable[[int, int], None] | None = None,
        *,
        refill_for: float = 0.0,
    ) -> ReconcileReport:
        """Lease one batch of due operations and settle what evidence allows.

        Up to ``concurrency`` checks run at once, each in a worker thread. The batch is
        leased for one check's time; a check that starts with less than one check's bound
        left on that lease (it waited behind others) first renews its own lease, fenced by
        version, so every check runs under a lease that covers it and an operation whose
        lease lapsed and was taken by another reconciler is skipped (``lost_race``).

        ``refill_for`` > 0 (the daemon's draining passes) keeps the checks busy: whenever
        fewer checks wait than run at once, the next batch is leased, for up to that many
        seconds from the pass's start; then the pass finishes what it holds. Without it a
        pass is one batch, and its last checks would run with free workers beside them.
        ``progress(done, picked)`` is called once a batch is leased and after each check.
        """
        report = ReconcileReport()
        started = time.monotonic()
        pending: deque[tuple[OperationRecord, datetime, float]] = deque()
        more = True  # whether leasing another batch may find work
        done = 0

        def tick(what: str | None = None) -> None:
            """A check finished (``what`` it found), or a batch was leased: report it."""
            nonlocal done
            if what is not None:
                report.add(what)  # the report and its callbacks: the calling thread only
                done += 1
            if progress is not None:
                progress(done, report.picked)

        def lease_more() -> None:
            nonlocal more
            stopping = stop is not None and stop.is_set()
            if report.picked and (stopping or time.monotonic() - started >= refill_for):
                more = False
                return
            # Measured before the claim: the lease was set by the DB clock after this.
            claimed_at = time.monotonic()
            batch = self.store.claim_due(
                owner=self.owner,
                lease=self.policy.lease,
                limit=self.policy.batch_size,
                tenant_ids=self.tenant_ids,
                on_quarantine=lambda _exc: report.add("quarantined"),
            )
            report.picked += len(batch)
            pending.extend((record, now, claimed_at) for record, now in batch)
            more = len(batch) == self.policy.batch_size  # a short batch: nothing more is due
            tick()

        lease_more()
        if not pending:
            return report
        if self.concurrency == 1:
            return self._check_inline(
                pending, report, stop=stop, tick=tick, lease_more=lease_more, more=lambda: more
            )
        finished: queue.SimpleQueue[Future[str]] = queue.SimpleQueue()
        running = 0
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="payorch-check") as pool:
            while True:
                if stop is not None and stop.is_set():
                    self._hand_back(pending, report)  # checks in flight finish
                elif more and len(pending) < self.concurrency:
                    lease_more()  # while the running checks wait on their providers
                while pending and running < self.concurrency:
                    record, now, claimed_at = pending.popleft()
                    # Each check in its own thread, under the caller's tracing context.
                    ctx = contextvars.copy_context()
                    job = pool.submit(ctx.run, self._check_leased, record, now, claimed_at)
                    job.add_done_callback(finished.put)  # one wake-up per finished check
                    running += 1
                if not running:
                    break
                tick(finished.get().result())
                running -= 1
        return report

    def _check_inline(
        self,
        pending: deque[tuple[OperationRecord, datetime, float]],
        report: ReconcileReport,
        *,
        stop: threading.Event | None,
        tick: Callable[[str], None],
        lease_more: Callable[[], None],
        more: Callable[[], bool],
    ) -> ReconcileReport:
        """One check at a time in the calling thread: no pool, and the only way under the
        async bridge, where database I/O must stay in the caller's greenlet."""
        while pending:
            if stop is not None and stop.is_set():
                self._hand_back(pending, report)
                break
            record, now, claimed_at = pending.popleft()
            tick(self._check_leased(record, now, claimed_at))
            if not pending and more():
                lease_more()
        return report

    def _hand_back(
        self, pending: deque[tuple[OperationRecord, datetime, float]], report: ReconcileReport
    ) -> None:
        """Graceful stop: leased operations not yet checked go back untouched instead of
        sitting on leases."""
        while pending:
            self.store.release(pending.popleft()[0])
            report.released += 1

    def _check_leased(self, record: OperationRecord, now: datetime, claimed_at: float) -> str:
        """One check of a claimed operation, renewing its lease first if the wait ate it."""
        try:
            left = self.policy.lease.total_seconds() - (time.monotonic() - claimed_at)
            if left < self.check_bound.total_seconds():
                # Queued behind other checks: restart the lease so it covers this check.
                # Fenced by version: if it lapsed and another reconciler took it, we skip.
                record, now = self.store.renew_lease(
                    record, owner=self.owner, lease=self.policy.lease
                )
            result = self.check(record, now)
        except StaleVersion:
            return "lost_race"
        except Exception as exc:  # noqa: BLE001 - one broken operation must not stall the rest
            return self._check_failed(record, now, exc)
        if CrossCheck.asked(record):  # routed, and moved on or passed a provider over
            self.check_crossings(record)
        return result

    def check_crossings(self, record: OperationRecord) -> list[str]:
        """Ask every provider a routed operation moved away from (:class:`CrossCheck`), as
        the operation stands now; a failure is logged, never raised."""
        try:
            return self.crossings.check(self.store.get(record.tenant_id, record.id))
        except Exception as exc:  # noqa: BLE001 - the operation's own check stands
            logs.reconciler_log.warning("cross-provider check of %s failed: %s", record.id, exc)
            return ["check_error"]

    def _check_failed(self, record: OperationRecord, now: datetime, exc: Exception) -> str:
        """Record the error as an event and look again later, with backoff."""
        detail = {"error": type(exc).__name__, "message": str(exc)[:500]}
        try:
            # The check may have written before failing (a re-submission): act on what is
            # stored now, and only while the lease is still ours.
            record = self.store.get(record.tenant_id, record.id)
            if record.lease_owner != self.owner:
                return "lost_race"
            # A failed check counts like any other toward max_checks / max_unknown_age, so an
            # operation whose checks keep raising ends flagged instead of retried unseen.
            if record.state is State.IN_PROGRESS and not record.possibly_sent:
                # Nothing was sent: no provider's word is needed, so it stays in_progress
                # (abandoned on a later pass) rather than becoming unknown.
                self._reschedule(record, now, kind="check_error", detail=detail, keep=True)
            else:
                # Unknown, or in_progress with an attempt possibly sent (its lease expired,
                # or our re-submission broke): unknown until evidence says otherwise.
                self._reschedule(record, now, kind="check_error", detail=detail)
        except StaleVersion:
            return "lost_race"
        except CorruptRecord:
            # Corrupted between the lease and the check: the next pass quarantines it.
            return "check_error"
        return "check_error"

    def run_until_idle(self, max_passes: int = 100) -> ReconcileReport:
        """Repeat passes until nothing is due (bounded); for tests, the demo and the CLI."""
        total = ReconcileReport()
        for _ in range(max_passes):
            report = self.reconcile_once()
            total.merge(report)
            if report.picked == 0:
                break
        return total

    # -- one operation ----------------------------------------------------------------

    @tracing.instrumented_check
    def check(self, record: OperationRecord, now: datetime) -> str:  # noqa: PLR0911 - per path
        """Settle one leased operation from evidence; returns what happened (for reports)."""
        if record.state is State.IN_PROGRESS and not record.possibly_sent:
            # No money can have moved, so no outcome is stored for it: released, the
            # namespace's next request runs it again (same downstream key).
            reason = {"reason": "lease expired and no attempt was possibly sent"}
            self._write(
                record,
                State.IN_PROGRESS,
                kind="abandoned",
                actor=self.owner,
                detail=reason,
                possibly_sent=False,  # as it was; it also wakes waiters, who may run it
            )
            return "abandoned"
        provider = self.providers.get(record.provider)
        if provider is None:
            logs.no_provider(record)
            self._reschedule(record, now, kind="check", detail={"error": "provider not configured"})
            return "no_provider"
        if record.resolution == VOID_REQUESTED:
            # A void is in flight: send the same void again until its evidence settles it;
            # never the payment itself.
            if can_void(provider, record.provider_reference):
                return run_void(
                    self, record, now, provider, actor=self.owner, reason="the void, again"
                )
            reason = {"decision": "escalate: a void is in flight and this adapter cannot void"}
            self._reschedule(record, now, kind="check", detail=reason, attention=True)
            return "escalated"
        if not can_query_status(provider):
            return self._without_status(record, now, provider)
        started = time.monotonic()
        answer = provider.query_status(StatusQuery(**query_of(record)))
        metrics.for_provider(provider.name).answered(
            "status", answer.kind, time.monotonic() - started
        )
        # Only the stored request is at hand: values under its redacted names go.
        answer = Redactor.of(record.request).answer(answer)
        detail = {
            "query": "status",
            "duration_ms": round((time.monotonic() - started) * 1000, 1),
            **answer.evidence(),
        }
        # "possibly sent" describes submissions; for a read it would only mislead.
        detail.pop("possibly_sent", None)
        duplicate = bool(answer.duplicates)
        if duplicate:
            # Two provider objects for one operation: settle by the evidence, but a human
            # must look at the second effect.
            found = (answer.provider_reference, *answer.duplicates)
            detail["duplicate"] = [ref for ref in found if ref is not None]
        decision = settled(answer)
        if decision is not None:
            self._finish(record, decision, kind="status_query", detail=detail, attention=duplicate)
            return decision.state.value
        if void_due(self, record, provider):
            # Unsettled past the policy's deadline: release the authorisation instead.
            record = self._write(
                record,
                State.OUTCOME_UNKNOWN,
                kind="status_query",
                actor=self.owner,
                detail=detail,
                lease=self.policy.lease,
                lease_owner=self.owner,
            )
            return run_void(self, record, now, provider, actor=self.owner, reason=_PAST_DEADLINE)
        if answer.kind is AnswerKind.NOT_FOUND:
            return self._not_found(record, now, provider, detail)
        # PENDING, or the provider is unavailable (AMBIGUOUS / NOT_SENT): look again later.
        what = "pending" if answer.kind is AnswerKind.PENDING else "provider_unavailable"
        self._reschedule(
            record,
            now,
            kind="status_query",
            detail=detail,
            reference=answer.provider_reference,
            attention=duplicate,
        )
        return what

    def _without_status(self, record: OperationRecord, now: datetime, provider: Provider) -> str:
        """A provider that cannot be asked: wait for its webhook, then replay the identical
        request inside its key window (its answer is the status), then void where the policy
        allows, and otherwise keep waiting for evidence, flagged for a human."""
        if void_due(self, record, provider):
            return run_void(self, record, now, provider, actor=self.owner, reason=_PAST_DEADLINE)
        age = self.store.db_time() - record.created_at
        detail: dict[str, Any] = {"query": "none", "capabilities": "no status query"}
        if age < self.policy.webhook_grace:
            detail["decision"] = "the provider cannot be asked: wait for its notification"
            self._reschedule(record, now, kind="awaiting_evidence", detail=detail)
            return "awaiting_evidence"
        if Capability.REPLAY not in capabilities_of(provider):
            reason = "the provider can neither be asked nor replayed: only its notification"
            detail["decision"] = f"escalate: {reason}; waiting for evidence"
            self._reschedule(record, now, kind="awaiting_evidence", detail=detail, attention=True)
            return "escalated"
        return resend_if_covered(
            self,
            record,
            now,
            provider,
            detail,
            kind="awaiting_evidence",
            actor_kind="replay",
            decision="no notification yet, within the key window: replay the request",
            age=age,  # just read by the database clock
        )

    def _not_found(
        self, record: OperationRecord, now: datetime, provider: Provider, detail: dict[str, Any]
    ) -> str:
        age = attempt_age(self.store, record, now)  # a routed one's: since its move
        if age < self.policy.not_found_grace:
            detail["decision"] = "not found within the grace period: wait"
            self._reschedule(record, now, kind="status_query", detail=detail)
            return "not_found_waiting"
        if (
            record.route is not None
            # Nothing of this attempt's is known at the provider (no reference of it, no
            # void of it wanted or refused): "not found" is all there is.
            and record.provider_reference is None
            and record.resolution not in VOID_WANTED
            and past_window(self, record, provider, now)
        ):
            # Routed: nothing under its key past the window, no notification: proven not
            # executed there, so its next provider may be asked.
            moved = fall_over(self, record, proof=Proof.NOT_FOUND, detail=detail)
            if moved is not None:
                return moved
        return resend_if_covered(
            self,
            record,
            now,
            provider,
            detail,
            kind="status_query",
            actor_kind="resubmission",
            decision="not found after grace, within the key window: re-submit",
        )

    # -- writes -----------------------------------------------------------------------

    def _finish(
        self,
        record: OperationRecord,
        decision: Decision,
        *,
        kind: str,
        detail: Mapping[str, Any],
        attention: bool = False,
    ) -> None:
        self._write(
            record,
            decision.state,
            kind=kind,
            actor=self.owner,
            detail=detail,
            response=decision.response,
            error_code=decision.error_code,
            resolution=kind,
            checks_delta=1,
            # Settled by evidence: nothing left for a human, unless the evidence says so or
            # a cross-provider duplicate flagged it (that flag stays until acknowledged).
            needs_attention=attention or cross_flag_open(self.store, record),
            provider_reference=decision.provider_reference,
        )
        if attention and not record.needs_attention:
            metrics.escalated("evidence")

    def _reschedule(
        self,
        record: OperationRecord,
        now: datetime,
        *,
        kind: str,
        detail: dict[str, Any],
        reference: str | None = None,
        attention: bool = False,
        keep: bool = False,
        **extra: Any,
    ) -> None:
        """Count a check without an outcome and schedule the next (``keep``: stay in_progress);
        ``extra`` values are written too (e.g. ``resolution``)."""
        checks = record.checks + 1
        delay = backoff_delay(
            checks,
            base=self.policy.base_delay,
            cap=self.policy.max_delay,
            rand=self._rand,
            floor=self.policy.base_delay,
        )
        too_old = now - record.created_at >= self.policy.max_unknown_age
        flag = attention or record.needs_attention or checks >= self.policy.max_checks or too_old
        escalation = None
        if flag and not record.needs_attention:
            escalation = "evidence" if attention else "max_age" if too_old else "max_checks"
            age_s = (now - record.created_at).total_seconds()
            detail["needs_attention"] = (
                "escalated" if attention else f"{checks} checks, {age_s:.0f}s old"
            )
        self._write(
            record,
            State.IN_PROGRESS if keep else State.OUTCOME_UNKNOWN,
            kind=kind,
            actor=self.owner,
            detail=detail,
            next_check_in=timedelta(seconds=delay),
            checks_delta=1,
            needs_attention=flag,
            provider_reference=reference,
            **extra,
        )
        if escalation is not None:
            metrics.escalated(escalation)

    def _write(self, record: OperationRecord, state: State, **values: Any) -> OperationRecord:
        """``store.transition``, logged (an escalation is a WARNING with its reason)."""
        after = self.store.transition(record, state, **values)
        logs.transition(
            record,
            after,
            values["kind"],
            values.get("detail"),
            logger=logs.reconciler_log,
            level=logs.DEBUG,  # a batch's lines; the pass is summed up at INFO
        )
        return after
