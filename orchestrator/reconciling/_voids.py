"""Void as a resolution: release an unknown authorisation instead of leaving money held.

A void is persisted before it is sent (the operation's ``resolution`` reads
``void_requested``), so a crash after sending leaves a mark: the next check sends the same
void again (its key is a pure function of the operation's), and evidence of a success that
arrives meanwhile is recorded and flagged instead of settling the operation. The void's own
answer is evidence like any other: void now (or nothing was ever made under the key) ends
``failed_final`` with code ``voided``; a void the provider took ends the same way once its
notification arrives, as does any release of the authorisation while a void is wanted
(Stripe's cancel of the authorised intent, whoever sent it: :data:`RELEASED`); a refused one
leaves the operation unknown and flagged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from ..core import State
from ..errors import StaleVersion
from ..observing import _metrics as metrics
from ..outcome import settled
from ..provider import Answer, AnswerKind, Provider, Voider, VoidRequest, can_void
from ..records import OperationRecord, Redactor
from ..routing import Proof
from ._fallbacks import Reconciler as Mover
from ._fallbacks import attempt_started, fall_over

__all__ = [
    "RELEASED",
    "VOIDED",
    "VOID_NOTHING_FOUND",
    "VOID_REFUSED",
    "VOID_REQUESTED",
    "VOID_RESOLUTION",
    "VOID_WANTED",
    "is_authorisation",
    "query_of",
    "run_void",
    "void_due",
    "void_refusal",
]


class Reconciler(Mover, Protocol):
    """What a void needs of the reconciler that runs it (``_reconciler.Reconciler``): what
    a move needs (a voided routed operation moves on), and its rescheduling write."""

    @property
    def _reschedule(self) -> Callable[..., None]: ...


VOID_REQUESTED = "void_requested"  # resolution of an unknown operation with a void in flight
VOID_RESOLUTION = "void"  # resolution of an operation settled by its void
VOIDED = "voided"  # error_code of a voided operation
# Resolutions of an unknown operation whose void did not settle it: never voided again by the
# policy, never re-sent (a void was wanted); evidence or a human settles it.
VOID_REFUSED = "void_refused"
VOID_NOTHING_FOUND = "void_nothing_found"
VOID_WANTED = frozenset({VOID_REQUESTED, VOID_REFUSED, VOID_NOTHING_FOUND})
# The lifecycles an adapter's event gives an authorisation no longer held: a void's own
# confirmation (the sandbox's, Adyen's CANCELLATION) and Stripe's cancel of an authorised
# intent (providers/stripe/_classify.py). While a void is wanted, either is the void's outcome.
RELEASED = frozenset({VOIDED, "authorization_released"})
_MAX_RACES = 3


def query_of(record: OperationRecord) -> dict[str, Any]:
    """What a status query (or a void) of ``record`` names: ``StatusQuery``'s fields."""
    return {
        "tenant_id": record.tenant_id,
        "operation": record.operation,
        "operation_id": record.id,
        "downstream_key": record.downstream_key,
        "provider_reference": record.provider_reference,
        "payload": record.request or {},
        "idempotency_key": record.idempotency_key,
        "fingerprint": record.fingerprint,
        "created_at": record.created_at,
    }


def is_authorisation(record: OperationRecord) -> bool:
    """Whether the operation only authorised (it asked for a manual capture)."""
    return (record.request or {}).get("capture_method") == "manual"


def void_refusal(  # noqa: PLR0911 - one reason per refusal
    record: OperationRecord, adapter: object | None, operations: frozenset[str]
) -> str | None:
    """Why ``record`` cannot be voided (by an operator, or the policy), or None if it can."""
    if record.state is State.SUCCEEDED:
        return (
            f"operation {record.id} is succeeded (terminal): what it authorised or captured "
            "is released by a refund or by cancelling it at the provider, not by a void"
        )
    if record.terminal:
        return f"operation {record.id} is {record.state.value} (terminal): nothing is held"
    if record.state is State.IN_PROGRESS and not record.possibly_sent:
        return f"operation {record.id} has sent nothing to the provider: there is nothing to void"
    if record.operation not in operations:
        return (
            f"operation {record.id} is a {record.operation}: only an authorisation of "
            f"{', '.join(sorted(operations)) or 'no type'} is voided"
        )
    if not is_authorisation(record):
        return (
            f"operation {record.id} captures at once (its capture_method is not manual): if "
            "it went through, the money moved; a void cannot undo a capture, a refund can"
        )
    if adapter is None:
        return f"provider {record.provider!r} is not configured here"
    if not can_void(adapter, record.provider_reference):
        return f"provider {record.provider!r} cannot void an operation"
    return None


def void_due(rec: Reconciler, record: OperationRecord, adapter: Provider) -> bool:
    """Whether the policy voids ``record`` now: opted in, past its deadline, voidable."""
    policy = rec.policy
    if policy.void_after is None or record.operation not in policy.void_operations:
        return False
    if record.resolution in (VOID_REFUSED, VOID_NOTHING_FOUND):
        return False
    # A routed operation that moved on: the deadline runs from its current attempt.
    started = attempt_started(rec.store, record) if record.route else record.created_at
    if rec.store.db_time() - started < policy.void_after:
        return False
    return void_refusal(record, adapter, policy.void_operations) is None


def run_void(
    rec: Reconciler,
    record: OperationRecord,
    now: datetime,
    adapter: Provider,
    *,
    actor: str,
    reason: str,
) -> str:
    """Void a leased operation: mark it, send the void, apply the answer. Returns what
    happened (``voided``, ``void_pending``, ``void_refused``, ``void_unavailable``)."""
    request = VoidRequest(**query_of(record), reason=reason, actor=actor)
    # Who wanted it: only the policy's own void may move a routed operation on (an
    # operator's settles it), also when the reconciler sends it again.
    by_policy = actor == rec.owner
    if record.resolution == VOID_REQUESTED:
        # Sent again: the policy's only while the policy sends it, and it asked first.
        by_policy = by_policy and _asked_by_policy(rec, record)
    else:
        # Persisted before the call, under the lease this check holds.
        record = rec._write(
            record,
            State.OUTCOME_UNKNOWN,
            kind=VOID_REQUESTED,
            actor=actor,
            detail={"reason": reason, "void_key": request.void_key, "by_policy": by_policy},
            lease=rec.policy.lease,
            lease_owner=rec.owner,
            resolution=VOID_REQUESTED,
        )
    started = time.monotonic()
    try:
        assert isinstance(adapter, Voider)  # can_void said so
        answer = adapter.void(request)
    except Exception as exc:  # noqa: BLE001 - an adapter's bug is evidence of nothing
        answer = Answer(kind=AnswerKind.AMBIGUOUS, code=type(exc).__name__, message=str(exc))
    metrics.for_provider(adapter.name).answered("void", answer.kind, time.monotonic() - started)
    answer = Redactor.of(record.request).answer(answer)
    detail: dict[str, Any] = {
        "query": "void",
        "duration_ms": round((time.monotonic() - started) * 1000, 1),
        **answer.evidence(),
    }
    detail.pop("possibly_sent", None)
    for _ in range(_MAX_RACES):
        try:
            return _apply(rec, record, now, answer, dict(detail), may_move=by_policy)
        except StaleVersion:
            # Written while the void was out (a webhook flagged a race, say): apply the
            # answer to the operation as it stands, while its void is still ours to settle.
            record = rec.store.get(record.tenant_id, record.id)
            if record.terminal or record.resolution != VOID_REQUESTED:
                rec.store.append_event(
                    record, kind="late_void_answer", actor=rec.owner, detail=detail
                )
                return "lost_race"
    raise StaleVersion(f"operation {record.id} kept changing", operation_id=record.id)


def _asked_by_policy(rec: Reconciler, record: OperationRecord) -> bool:
    """Whether the void in flight was the policy's (its ``void_requested`` event says so)."""
    if record.route is None:
        return False  # only a routed operation asks: nothing to read otherwise
    asked = [e for e in rec.store.events(record.tenant_id, record.id) if e.kind == VOID_REQUESTED]
    return bool(asked) and bool((asked[-1].detail or {}).get("by_policy"))


def _apply(
    rec: Reconciler,
    record: OperationRecord,
    now: datetime,
    answer: Answer,
    detail: dict[str, Any],
    *,
    may_move: bool = False,
) -> str:
    if answer.kind is AnswerKind.SUCCEEDED:
        return _voided(rec, record, answer, detail, may_move=may_move)
    if answer.kind is AnswerKind.NOT_FOUND:
        # Nothing held under the key, but the key is not blocked (only a provider that says
        # so, answering SUCCEEDED, blocks it): never final, and never voided again by the
        # policy; no re-send either. Evidence or a human settles it.
        detail["decision"] = "nothing to void was found: wait for evidence, never re-send"
        rec._reschedule(record, now, kind="void", detail=detail, resolution=VOID_NOTHING_FOUND)
        return "void_nothing_found"
    if answer.kind is AnswerKind.DECLINED:
        detail["decision"] = f"escalate: the provider refused the void ({answer.code})"
        rec._reschedule(
            record, now, kind="void", detail=detail, attention=True, resolution=VOID_REFUSED
        )
        return "void_refused"
    pending = answer.kind is AnswerKind.PENDING
    detail["decision"] = (
        "the provider took the void: its notification settles the operation"
        if pending
        else "the void is not confirmed yet: the next check sends it again"
    )
    rec._reschedule(record, now, kind="void", detail=detail, reference=answer.provider_reference)
    return "void_pending" if pending else "void_unavailable"


def _voided(
    rec: Reconciler,
    record: OperationRecord,
    answer: Answer,
    detail: dict[str, Any],
    *,
    may_move: bool = False,
) -> str:
    ref = answer.provider_reference or record.provider_reference
    if record.route is not None and may_move:
        # Routed: the provider confirmed nothing stands under the key; its next may be asked.
        moved = fall_over(rec, record, proof=Proof.VOIDED, detail=detail, code=VOIDED)
        if moved is not None:
            return moved
    decision = settled(Answer(kind=AnswerKind.DECLINED, code=VOIDED, provider_reference=ref))
    assert decision is not None
    rec._write(
        record,
        State.FAILED_FINAL,
        kind="void",
        actor=rec.owner,
        detail=detail,
        response=decision.response,
        error_code=decision.error_code,
        resolution=VOID_RESOLUTION,
        checks_delta=1,
        # A late success that raced the void flagged it: that flag stays for a human.
        needs_attention=record.needs_attention,
        provider_reference=ref,
    )
    return VOIDED
