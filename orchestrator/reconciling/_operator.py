"""Operator actions on one operation: an audited resolution, a status check on demand, and
the acknowledgement that clears a terminal operation's ``needs_attention`` flag.

Resolution and recheck respect the lease: whoever holds a live lease (an executor mid-call,
a reconciler mid-check) owns the operation until it expires, judged by the database clock.
All three write through fenced statements, so a concurrent writer makes them fail with
``StaleVersion`` rather than overwrite what it decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core import State
from ..errors import (
    InvalidRequest,
    InvalidTransition,
    OperationInProgress,
    OperationNotFound,
    StaleVersion,
    UnknownProvider,
)
from ..records import OperationRecord
from ..storage._engine import read_in_transaction, run_in_transaction
from ..storage._statements import add_event
from ..storage._store import Store
from ..storage._tables import db_now, operations
from ._reconciler import Reconciler
from ._voids import run_void, void_refusal

__all__ = [
    "ACKNOWLEDGED_EVENT",
    "RESOLUTION_EVENT",
    "VOID_EVENT",
    "RecheckResult",
    "acknowledge",
    "check_acknowledgeable",
    "check_resolvable",
    "load",
    "recheck",
    "resolve",
    "void",
]

RESOLUTION_EVENT = "operator_resolution"
RECHECK_EVENT = "operator_recheck"
VOID_EVENT = "operator_void"  # the lease an operator's void takes
ACKNOWLEDGED_EVENT = "acknowledged"
MAX_ACTOR = 200  # payorch_events.actor
MAX_REASON = 2000
MAX_REFERENCE = 255  # payorch_operations.provider_reference


@dataclass(frozen=True, kw_only=True)
class RecheckResult:
    """What the check did (the reconciler's word, e.g. ``succeeded``, ``pending``)."""

    outcome: str
    before: OperationRecord
    record: OperationRecord


def load(
    store: Store, tenant_id: str | None, operation_id: str
) -> tuple[OperationRecord, datetime]:
    """The operation and the database time; without a tenant, a cross-tenant lookup by id."""
    t = operations.c
    where = [t.id == operation_id]
    if tenant_id is not None:
        where.append(t.tenant_id == tenant_id)

    def read(conn: Connection) -> list[Any]:
        query = sa.select(operations, db_now().label("_now")).where(*where).limit(2)
        return list(conn.execute(query).mappings().all())

    rows = read_in_transaction(store.engine, read)
    if not rows:
        scope = f" for tenant {tenant_id}" if tenant_id is not None else ""
        raise OperationNotFound(f"no operation {operation_id}{scope}")
    if len(rows) > 1:
        raise InvalidRequest(f"operation id {operation_id} exists for several tenants; pass one")
    return OperationRecord.from_row(rows[0]), rows[0]["_now"]


def _lease_remaining(record: OperationRecord, now: datetime) -> float:
    if record.lease_expires_at is None:
        return 0.0
    return (record.lease_expires_at - now).total_seconds()


def refuse_live_lease(record: OperationRecord, now: datetime) -> None:
    """OperationInProgress while a worker or a reconciler holds ``record``'s lease."""
    remaining = _lease_remaining(record, now)
    if remaining > 0:
        holder = record.lease_owner or "another worker"
        raise OperationInProgress(
            f"operation {record.id} is leased by {holder} for {remaining:.0f}s more",
            operation_id=record.id,
            retry_after=max(1.0, round(remaining, 1)),
        )


def check_resolvable(record: OperationRecord, now: datetime) -> None:
    """Refuse what an operator may not resolve: terminal, or held by a live lease.

    ``outcome_unknown`` and an abandoned ``in_progress`` (lease expired, nothing possibly
    sent) are resolvable; a possibly-sent ``in_progress`` must be checked first. An
    ``outcome_unknown`` the reconciler is checking right now is refused too: its evidence
    may be about to land, and a resolution must not race it.
    """
    if record.terminal:
        raise InvalidTransition(
            f"operation {record.id} is already {record.state.value} (terminal); "
            "a correction is a new operation, e.g. a refund",
            operation_id=record.id,
        )
    refuse_live_lease(record, now)
    if record.state is State.IN_PROGRESS and record.possibly_sent:
        # Not abandoned: a worker died after (possibly) sending. The provider may hold an
        # effect nobody has asked about yet; its evidence comes first.
        raise InvalidTransition(
            f"operation {record.id} is in_progress and possibly sent: the provider may hold "
            "an effect; run `payorch ops recheck` (or let the reconciler check it) first",
            operation_id=record.id,
        )


def required_text(value: str | None, name: str, limit: int, action: str = "a resolution") -> str:
    """``value`` stripped; ``InvalidRequest`` when empty or over ``limit`` (audit fields)."""
    text = (value or "").strip()
    if not text:
        raise InvalidRequest(f"{action} needs a non-empty {name}")
    if len(text) > limit:
        raise InvalidRequest(f"{name} is longer than {limit} characters")
    return text


def resolve(
    store: Store,
    tenant_id: str | None,
    operation_id: str,
    *,
    to: State,
    reason: str,
    actor: str,
    provider_reference: str | None = None,
    expected_version: int | None = None,
) -> OperationRecord:
    """Settle an unknown or abandoned operation by an operator's decision: one audit event.

    ``expected_version`` makes the decision apply only to the operation as the operator saw
    it (e.g. when it was shown for confirmation).
    """
    reason = required_text(reason, "reason", MAX_REASON)
    actor = required_text(actor, "actor", MAX_ACTOR)
    if not to.terminal:
        raise InvalidRequest(f"an operator resolves to succeeded or failed_final, not {to.value}")
    reference = provider_reference.strip() if provider_reference else None
    if reference is not None and len(reference) > MAX_REFERENCE:
        raise InvalidRequest(f"provider reference is longer than {MAX_REFERENCE} characters")
    record, now = load(store, tenant_id, operation_id)
    if expected_version is not None and record.version != expected_version:
        raise StaleVersion(
            f"operation {record.id} changed since it was shown (version {expected_version}, "
            f"now {record.version}); look again",
            operation_id=record.id,
        )
    check_resolvable(record, now)
    final_reference = reference or record.provider_reference
    detail: dict[str, Any] = {
        "reason": reason,
        "provider_reference": reference,
        "lease_expired_at": (
            record.lease_expires_at.isoformat() if record.lease_expires_at else None
        ),
        "possibly_sent": record.possibly_sent,
        "checks": record.checks,
    }
    if reference is not None and record.provider_reference not in (None, reference):
        detail["replaced_provider_reference"] = record.provider_reference
    if to is State.SUCCEEDED:
        response: dict[str, Any] = {
            "status": "succeeded",
            "http_status": 200,
            "provider_reference": final_reference,
            "resolution": "operator",
        }
        error_code = None
    else:
        response = {
            "status": "failed",
            "http_status": 402,
            "code": "operator_resolved",
            "message": "resolved as failed by an operator",
            "provider_reference": final_reference,
            "resolution": "operator",
        }
        error_code = "operator_resolved"
    return store.transition(
        record,
        to,
        kind=RESOLUTION_EVENT,
        actor=actor,
        detail=detail,
        provider_reference=final_reference,
        response=response,
        error_code=error_code,
        resolution="operator",
        needs_attention=False,  # a human has decided; the evidence stays in the log
    )


def _take_lease(
    store: Store, record: OperationRecord, *, owner: str, actor: str, lease_seconds: float
) -> tuple[OperationRecord, datetime]:
    """Lease one operation if its lease is free or expired: one fenced UPDATE + an event."""
    return store.lease_one(
        record,
        owner=owner,
        lease=timedelta(seconds=lease_seconds),
        kind=RECHECK_EVENT,
        actor=actor,
        detail={"lease_owner": owner, "lease_seconds": lease_seconds},
    )


def recheck(
    store: Store,
    reconciler: Reconciler,
    tenant_id: str | None,
    operation_id: str,
    *,
    actor: str = "operator",
) -> RecheckResult:
    """Ask the provider now and apply the evidence, exactly as the reconciler would; a
    routed operation that moved on also has every provider it left asked again (a settled
    one only that)."""
    actor = required_text(actor, "actor", MAX_ACTOR)
    record, now = load(store, tenant_id, operation_id)
    moved = bool(reconciler.crossings.asked(record))
    if record.terminal and moved:
        results = reconciler.check_crossings(record)
        return RecheckResult(
            outcome="the providers it left: " + ", ".join(results),
            before=record,
            record=store.get(record.tenant_id, record.id),
        )
    if record.terminal:
        raise InvalidTransition(
            f"operation {record.id} is already {record.state.value} (terminal); nothing to check",
            operation_id=record.id,
        )
    refuse_live_lease(record, now)
    asks_provider = not (record.state is State.IN_PROGRESS and not record.possibly_sent)
    if asks_provider and record.provider not in reconciler.providers:
        # Checked before leasing: without the adapter the check would only reschedule.
        raise UnknownProvider(
            f"provider {record.provider!r} is not configured here: run the tools with the "
            "app's adapters (PAYORCH_PROVIDERS=module:attribute)"
        )
    leased, now = _take_lease(
        store,
        record,
        owner=reconciler.owner,
        actor=actor,
        lease_seconds=reconciler.policy.lease.total_seconds(),
    )
    outcome = reconciler.check(leased, now)
    if moved:
        reconciler.check_crossings(record)
    return RecheckResult(
        outcome=outcome, before=record, record=store.get(record.tenant_id, record.id)
    )


def void(
    store: Store,
    reconciler: Reconciler,
    tenant_id: str | None,
    operation_id: str,
    *,
    reason: str,
    actor: str,
) -> RecheckResult:
    """Void an unknown authorisation at the provider now, audited (actor and reason).

    Refused with the reason, before anything is written or sent: a terminal operation
    (succeeded: a refund undoes it; failed: nothing is held), one that captures at once, one
    that sent nothing, one whose provider cannot void, one leased right now. The void's
    answer is applied as the reconciler applies it (``voided``, ``void_pending``, …).
    """
    reason = required_text(reason, "reason", MAX_REASON, "a void")
    actor = required_text(actor, "actor", MAX_ACTOR, "a void")
    record, now = load(store, tenant_id, operation_id)
    adapter = reconciler.providers.get(record.provider)
    refusal = void_refusal(record, adapter, reconciler.policy.void_operations)
    if refusal is not None:
        raise InvalidTransition(f"cannot void: {refusal}", operation_id=record.id)
    assert adapter is not None
    refuse_live_lease(record, now)
    leased, now = store.lease_one(
        record,
        owner=reconciler.owner,
        lease=reconciler.policy.lease,
        kind=VOID_EVENT,
        actor=actor,
        detail={"reason": reason, "lease_owner": reconciler.owner},
    )
    outcome = run_void(reconciler, leased, now, adapter, actor=actor, reason=reason)
    return RecheckResult(
        outcome=outcome, before=record, record=store.get(record.tenant_id, record.id)
    )


def check_acknowledgeable(record: OperationRecord) -> None:
    """Refuse what an acknowledgement may not clear: an unflagged or unsettled operation.

    Only a terminal operation is acknowledged: its state stands, and the flag says a human
    should look at evidence that came after it (a contradicting webhook, a duplicate effect,
    a late answer). A flagged ``outcome_unknown`` or ``in_progress`` still needs its outcome,
    so it is rechecked or resolved, never waved through.
    """
    if not record.terminal:
        raise InvalidTransition(
            f"operation {record.id} is {record.state.value}, not settled: its outcome is still "
            "open; run `payorch ops recheck` or `payorch ops resolve`, not ack",
            operation_id=record.id,
        )
    if not record.needs_attention:
        raise InvalidTransition(
            f"operation {record.id} is not flagged for attention: nothing to acknowledge",
            operation_id=record.id,
        )


def acknowledge(
    store: Store,
    tenant_id: str | None,
    operation_id: str,
    *,
    reason: str,
    actor: str,
    expected_version: int | None = None,
) -> OperationRecord:
    """Clear a terminal operation's ``needs_attention`` flag: one fenced write, one audit event.

    The state, outcome and evidence stay as they are; the ``acknowledged`` event keeps the
    actor, the reason and the version that was looked at. ``expected_version`` makes the
    acknowledgement apply only to the operation as the operator saw it: evidence that
    arrived in between (a new flag) is refused with ``StaleVersion``, to be looked at first.
    """
    reason = required_text(reason, "reason", MAX_REASON, "an acknowledgement")
    actor = required_text(actor, "actor", MAX_ACTOR, "an acknowledgement")
    record, _ = load(store, tenant_id, operation_id)
    if expected_version is not None and record.version != expected_version:
        raise StaleVersion(
            f"operation {record.id} changed since it was shown (version {expected_version}, "
            f"now {record.version}); look again",
            operation_id=record.id,
        )
    check_acknowledgeable(record)
    t = operations.c
    # Fenced on version, and on the state and flag it was judged by: a concurrent writer
    # makes the UPDATE match nothing, and nothing is written.
    stmt = (
        sa.update(operations)
        .where(
            t.tenant_id == record.tenant_id,
            t.id == record.id,
            t.version == record.version,
            t.state == record.state.value,
            t.needs_attention.is_(True),
        )
        .values(needs_attention=False, version=t.version + 1, updated_at=db_now())
        .returning(*operations.c)
    )
    detail = {"reason": reason, "state": record.state.value, "version": record.version}

    def txn(conn: Connection) -> OperationRecord:
        row = conn.execute(stmt).mappings().first()
        if row is None:
            raise StaleVersion(
                f"operation {record.id} changed since version {record.version}; look again",
                operation_id=record.id,
            )
        updated = OperationRecord.from_row(row)
        add_event(
            conn,
            updated,
            kind=ACKNOWLEDGED_EVENT,
            actor=actor,
            from_state=None,
            to_state=None,
            detail=detail,
        )
        return updated

    return run_in_transaction(store.engine, txn)
