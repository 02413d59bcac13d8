"""One effect from claim to recorded outcome, synchronously: the driver every form shares.

:func:`start` claims the key (or takes over a run nobody holds, or escalates one whose
worker died after it may have reached the outside), then marks the run possibly sent;
or it answers with what is stored. The caller runs the effect, then :func:`finish`
records its result, or :func:`fail` records what its exception means. The async forms run
these very functions under ``storage._bridge.run_bridged``.

A run ends with one fenced write. If that write finds the version changed, the lease had
lapsed and another call acted: the run's answer is then evidence (:func:`_late`), which
settles an escalated effect and otherwise overwrites nothing. Either way the caller gets
what the key then holds (:func:`_stored_answer`), never an answer only it was given.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..core import State
from ..errors import (
    CommitUncertain,
    ConfigurationError,
    OperationInProgress,
    OutcomeNotRecorded,
    PayorchError,
    StaleVersion,
    StorageError,
    UnencodableRequest,
)
from ..observing._logs import emit
from ..storage._bridge import pause
from ..storage._store import Store
from . import _metrics as metrics
from ._rules import (
    LEASE_EXPIRED,
    Kind,
    Verdict,
    classify,
    error_doc,
    failed,
    in_progress,
    judge,
    replay,
    reused,
    storable,
    unknown,
)
from ._sql import claim_row, read_row, update_row
from ._values import Effect, EffectRecord, EffectResult, Policy, Target

__all__ = ["Running", "fail", "finish", "start"]

log = logging.getLogger("payorch.once")

_STALE_ATTEMPTS = 5  # racing takers of one key: then "in progress"
_FIRST_NAP, _NAP_CAP = 0.02, 0.25  # a bounded wait polls with backoff


@dataclass(frozen=True, slots=True, kw_only=True)
class Running:
    """A run under way: the record as marked, and what the function is told."""

    record: EffectRecord
    effect: Effect
    policy: Policy


def start(store: Store, policy: Policy, target: Target) -> Running | EffectResult:
    """Claim ``target`` and mark the run possibly sent, or the stored answer: a replay
    (returned) or ``IdempotencyKeyReused`` / ``EffectFailed`` / ``EffectOutcomeUnknown`` /
    ``OperationInProgress`` (raised). ``policy.wait`` bounds a wait for a run in progress."""
    try:
        return _start(store, policy, target)
    except StorageError:
        metrics.counted(policy.namespace, "storage_error")
        raise


def _start(store: Store, policy: Policy, target: Target) -> Running | EffectResult:
    ends = None if policy.wait is None else time.monotonic() + policy.wait.total_seconds()
    nap, stale = _FIRST_NAP, 0
    while True:
        record, now, created = claim_row(store, policy, target)
        verdict = judge(record, target.fingerprint, now, rerun_safe=policy.rerun_safe)
        try:
            if created:
                return _mark(store, policy, record, rerun=False)
            if verdict is Verdict.TAKE_OVER:
                return _take_over(store, policy, record)
            if verdict is Verdict.ESCALATE:
                escalated = _escalate(store, record)
                metrics.counted(policy.namespace, "escalated")
                raise unknown(escalated)
        except StaleVersion:
            stale += 1  # another call moved it first: judge the key again
            if stale < _STALE_ATTEMPTS:
                continue
            metrics.counted(policy.namespace, "in_progress")
            raise OperationInProgress(
                f"effect {record.id} is being taken over by another call",
                operation_id=record.id,
                retry_after=1.0,
            ) from None
        if verdict is Verdict.IN_PROGRESS and ends is not None:
            left = ends - time.monotonic()
            if left > 0:
                pause(min(nap, left))  # on an event loop (bridged) this awaits
                nap = min(nap * 2, _NAP_CAP)
                continue
        return _answer(verdict, record, now)


_ANSWERED = {
    Verdict.REPLAY: "replayed",
    Verdict.REUSED: "key_reused",
    Verdict.FAILED: "failed_replayed",
    Verdict.UNKNOWN: "unknown",
    Verdict.IN_PROGRESS: "in_progress",
}


def _answer(verdict: Verdict, record: EffectRecord, now: datetime) -> EffectResult:
    answer = _answered(verdict, record, now)
    if isinstance(answer, PayorchError):
        raise answer
    return answer


def _answered(verdict: Verdict, record: EffectRecord, now: datetime) -> EffectResult | PayorchError:
    """The answer of a stored effect (a replay, or the error to raise), counted."""
    metrics.counted(record.namespace, _ANSWERED[verdict])
    if verdict is Verdict.REPLAY:
        return replay(record)
    if verdict is Verdict.REUSED:
        return reused(record)
    if verdict is Verdict.FAILED:
        return failed(record)
    if verdict is Verdict.UNKNOWN:
        return unknown(record)
    return in_progress(record, now)


def _mark(store: Store, policy: Policy, record: EffectRecord, *, rerun: bool) -> Running:
    """Possibly sent from here on: committed before the effect runs. If this write fails,
    nothing ran (the run is abandoned, the next call takes it over); if its commit is in
    doubt, nothing runs either: ``CommitUncertain``, retry the same key."""
    marked = update_row(
        store,
        record,
        {"possibly_sent": True, "lease_owner": policy.owner},
        lease=policy.lease,
        attempts_delta=1,
    )
    return Running(record=marked, effect=policy.effect(marked, rerun=rerun), policy=policy)


def _take_over(store: Store, policy: Policy, record: EffectRecord) -> Running:
    # Back in hand: an escalated effect that may run again (rerun_safe) is no one's to
    # look at any more. Not yet marked: a takeover that dies here was never sent by us.
    taken = update_row(
        store,
        record,
        {"state": State.IN_PROGRESS.value, "lease_owner": policy.owner, "needs_attention": False},
        lease=policy.lease,
        lapsed=True,
    )
    emit(log, logging.INFO, "effect.taken_over", **_fields(taken), from_state=record.state.value)
    return _mark(store, policy, taken, rerun=record.possibly_sent)


def _escalate(store: Store, record: EffectRecord) -> EffectRecord:
    """A lapsed lease over a run that may have reached the outside: outcome_unknown, for an
    operator. Fenced and lapsed at write time, so a live worker is never escalated."""
    doc = {"kind": LEASE_EXPIRED, "type": "LeaseExpired", "message": "the worker's lease lapsed"}
    escalated = update_row(
        store,
        record,
        {
            "state": State.OUTCOME_UNKNOWN.value,
            "needs_attention": True,
            "error": {**doc, "previous": record.error} if record.error else doc,
            "lease_owner": None,
            "lease_expires_at": None,
        },
        lapsed=True,
    )
    _flagged(escalated, LEASE_EXPIRED)
    return escalated


# -- the end of a run -------------------------------------------------------------------


def finish(store: Store, running: Running, value: Any) -> EffectResult:
    """Record the effect's result; every caller gets it back as stored (JSON's form)."""
    policy, record = running.policy, running.record
    try:
        stored = storable(value)
    except (UnencodableRequest, TypeError, ValueError) as exc:
        raise _unstorable(store, running, exc) from exc
    values = {"state": State.SUCCEEDED.value, "result": stored, "error": None}
    try:
        done = _record_success(store, running, values)
    except StorageError as exc:
        metrics.counted(policy.namespace, "storage_error")
        raise _not_recorded(record, exc) from exc
    if isinstance(done, EffectResult):
        return done  # another answer stands: it is this caller's too
    if isinstance(done, PayorchError):
        raise done
    metrics.counted(policy.namespace, "fresh")
    return EffectResult(
        value=stored,
        replayed=False,
        effect_id=done.id,
        tenant_id=done.tenant_id,
        namespace=done.namespace,
        key=done.key,
        attempts=running.record.attempts,
    )


def _record_success(
    store: Store, running: Running, values: dict[str, Any]
) -> EffectRecord | EffectResult | PayorchError:
    """The record this run's result was written to (or, late, settled); else what the key
    holds instead (:func:`_stored_answer`)."""
    try:
        done = update_row(
            store,
            running.record,
            {**values, "needs_attention": False},  # a success needs nobody
            terminal=True,
            retention=running.policy.retention,
        )
    except StaleVersion:
        settled = _late(store, running, State.SUCCEEDED, values)
        return settled if settled is not None else _stored_answer(store, running)
    emit(log, logging.INFO, "effect.recorded", **_fields(done))
    return done


def fail(store: Store, running: Running, exc: Exception) -> PayorchError | EffectResult | None:
    """Record what ``exc`` means; return the error to raise instead of it, or None to let
    it through (retry_on, and rerun_safe runs: the same key runs again). A run that lost
    its lease meanwhile answers what the key now holds: the error that means, or, if the
    key succeeded without it, the stored result (a replay) to return instead."""
    policy, record = running.policy, running.record
    kind = classify(exc, policy)
    doc = error_doc(exc, kind)
    try:
        if kind is Kind.FINAL:
            return _record_final(store, running, doc)
        if kind is Kind.RETRY or policy.rerun_safe:
            # Released: no lease, so the next call runs it at once. ``possibly_sent`` says
            # whether any run may have reached the outside (sticky once true).
            sent = kind is Kind.POSSIBLY_SENT or running.effect.rerun
            _release(store, running, doc, possibly_sent=sent)
            return None
        return _record_unknown(store, running, doc)
    except StorageError as err:
        metrics.counted(policy.namespace, "storage_error")
        raise _not_recorded(record, err) from err


def _record_final(
    store: Store, running: Running, doc: dict[str, Any]
) -> PayorchError | EffectResult:
    values = {"state": State.FAILED_FINAL.value, "error": doc, "needs_attention": False}
    try:
        done = update_row(
            store, running.record, values, terminal=True, retention=running.policy.retention
        )
    except StaleVersion:
        settled = _late(store, running, State.FAILED_FINAL, {"error": doc})
        if settled is None:
            return _stored_answer(store, running)
        done = settled  # its error: this one's, marked late
    else:
        emit(log, logging.INFO, "effect.recorded", **_fields(done), error_type=doc["type"])
    metrics.counted(running.policy.namespace, "failed")
    return failed(done)


def _record_unknown(
    store: Store, running: Running, doc: dict[str, Any]
) -> PayorchError | EffectResult:
    values = {
        "state": State.OUTCOME_UNKNOWN.value,
        "error": doc,
        "needs_attention": True,
        "lease_owner": None,
        "lease_expires_at": None,
    }
    try:
        done = update_row(store, running.record, values)
    except StaleVersion:
        _late(store, running, State.OUTCOME_UNKNOWN, {"error": doc})  # settles nothing
        return _stored_answer(store, running)
    _flagged(done, doc["kind"], error_type=doc["type"])
    metrics.counted(running.policy.namespace, "escalated")
    return unknown(done)


def _release(store: Store, running: Running, doc: dict[str, Any], *, possibly_sent: bool) -> None:
    values = {"error": doc, "possibly_sent": possibly_sent}
    values.update(lease_owner=None, lease_expires_at=None)
    try:
        done = update_row(store, running.record, values)
    except StaleVersion:
        _late(store, running, State.IN_PROGRESS, {"error": doc})
    else:
        emit(log, logging.INFO, "effect.released", **_fields(done), error_type=doc["type"])
    metrics.counted(running.policy.namespace, "released")


def _unstorable(store: Store, running: Running, exc: Exception) -> PayorchError:
    """The effect ran and its result has no JSON form: the fact that it ran must not be
    lost, so it is escalated (never run again), and the caller learns of the bug."""
    doc = error_doc(exc, "unencodable_result")
    try:
        _record_unknown(store, running, doc)
    except StorageError as err:
        metrics.counted(running.policy.namespace, "storage_error")
        raise _not_recorded(running.record, err) from err
    return ConfigurationError(
        f"effect {running.record.id} ran, but its result ({type(exc).__name__}: "
        f"{doc['message']}) cannot be stored as JSON; it is escalated for an operator and "
        "will not run again under this key: return JSON (dicts, lists, str, int, float, "
        "bool, None)"
    )


def _late(
    store: Store, running: Running, state: State, values: dict[str, Any]
) -> EffectRecord | None:
    """The run's own lease was lost (it outran it) and another call wrote meanwhile. An
    effect escalated for that lapse is settled by this answer, which is evidence of what
    happened: the record so settled is returned. Anything else stays as the current holder
    or an operator decided (None: the caller answers from what is stored)."""
    found = read_row(store, running.record.tenant_id, running.record.namespace, running.record.key)
    current = found[0] if found is not None else None
    settled: EffectRecord | None = None
    if (
        current is not None
        and current.id == running.record.id
        and current.state is State.OUTCOME_UNKNOWN
        and state.terminal
    ):
        error = values.get("error")
        late = {"late": True, "previous": current.error}
        # Lost (StaleVersion): an operator or a re-run decided first, and theirs stands.
        with contextlib.suppress(StaleVersion):
            settled = update_row(
                store,
                current,
                {
                    **values,
                    "state": state.value,
                    "needs_attention": False,
                    "error": {**error, **late} if error else late,
                },
                terminal=True,
                retention=running.policy.retention,
            )
    emit(
        log,
        logging.WARNING,
        "effect.late_answer",
        **_fields(running.record),
        answer=state.value,
        settled=settled is not None,
        now_state=current.state.value if current is not None else None,
    )
    return settled


def _stored_answer(store: Store, running: Running) -> EffectResult | PayorchError:
    """What a run whose answer did not stand tells its caller: what the key holds now, read
    again (what every other caller gets), counted as that answer. A replay is returned;
    the rest is the error to raise: ``EffectFailed``, ``EffectOutcomeUnknown``, or
    ``OperationInProgress`` while another run holds the key (or may: ask again)."""
    record = running.record
    found = read_row(store, record.tenant_id, record.namespace, record.key)
    if found is None:  # gone (purged) under a run that did happen: nothing stands for it
        metrics.counted(record.namespace, "storage_error")
        return OutcomeNotRecorded(
            f"effect {record.id} ran (or may have), and its outcome could not be recorded; "
            "ask again with the same key later",
            operation_id=record.id,
        )
    current, now = found
    # Judged as the next call would, and never acted on: this call runs nothing more.
    verdict = judge(current, record.fingerprint, now, rerun_safe=running.policy.rerun_safe)
    if verdict in (Verdict.TAKE_OVER, Verdict.ESCALATE):
        verdict = Verdict.IN_PROGRESS  # nobody holds it now: the next call decides
    return _answered(verdict, current, now)


def _not_recorded(record: EffectRecord, exc: StorageError) -> OutcomeNotRecorded:
    kind = CommitUncertain if isinstance(exc, CommitUncertain) else OutcomeNotRecorded
    return kind(
        f"effect {record.id} ran (or may have), and its outcome could not be recorded; ask "
        "again with the same key later: it will not silently run twice",
        operation_id=record.id,
        retry_after=exc.retry_after,
    )


def _fields(record: EffectRecord) -> dict[str, Any]:
    # Identifiers and classifications only: never the key (a message id may be anything).
    return {
        "effect_id": record.id,
        "tenant_id": record.tenant_id,
        "namespace": record.namespace,
        "state": record.state.value,
        "attempt": record.attempts,
    }


def _flagged(record: EffectRecord, reason: str, error_type: str | None = None) -> None:
    emit(
        log,
        logging.WARNING,
        "effect.needs_attention",
        **_fields(record),
        reason=reason,
        error_type=error_type,
    )
