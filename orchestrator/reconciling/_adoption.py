"""The store writes that adopt a provider effect no operation explains.

A namespace no row holds: one transaction, ``INSERT … ON CONFLICT (tenant_id, operation,
idempotency_key) DO NOTHING RETURNING`` of the operation, already in the state its evidence
proves, its ``adopted`` event and, when that state is terminal, the messages the store's
outbox hooks stage for it. The unique constraint decides a race with the client's own retry,
as it decides between two claims: whichever commits first holds the namespace, the other
inserts nothing.

A namespace a *released* row holds (the client's retry re-created the lost claim and sent
nothing: :attr:`~payorch.records.OperationRecord.released`): one version-fenced
``Store.transition`` of that row to the state the evidence proves, which stages the hooks'
messages as every settling transition does. A retry that takes the row over first moves its
version, and the adoption loses with ``StaleVersion``.

The decisions (what is adoptable, in which state) are :mod:`payorch.reconciling._unexplained`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from ..outcome import Decision
from ..records import NewOperation, OperationRecord
from ..storage._engine import run_in_transaction
from ..storage._outbox import stage_settled, staging
from ..storage._statements import add_event, new_id
from ..storage._store import Store
from ..storage._tables import db_now, db_now_plus, operations

__all__ = ["ADOPTED_EVENT", "ADOPTED_RESOLUTION", "adopt_released", "insert_adopted"]

ADOPTED_EVENT = "adopted"
ADOPTED_RESOLUTION = "adopted"


def insert_adopted(
    store: Store,
    new: NewOperation,
    decision: Decision,
    *,
    provider_reference: str,
    actor: str,
    detail: Mapping[str, Any],
) -> OperationRecord | None:
    """Create ``new``'s operation in ``decision``'s state, flagged for attention, with its
    ``adopted`` event and what the store's outbox hooks stage for that outcome; None when the
    namespace is already held (nothing written).

    A terminal operation is complete at once (its retention starts now); an
    ``outcome_unknown`` one is due for the reconciler's first check now.
    """
    state = decision.state
    terminal = state.terminal
    values: dict[str, Any] = {
        "tenant_id": new.tenant_id,
        "id": new_id(),
        "operation": new.operation,
        "idempotency_key": new.idempotency_key,
        "fingerprint": new.fingerprint,
        "state": state.value,
        "provider": new.provider,
        "downstream_key": new.downstream_key,
        "provider_reference": provider_reference,
        "amount": new.amount,
        "currency": new.currency,
        # The client's request was lost with its claim: only the provider's object is known.
        "request": None,
        "response": decision.response,
        "error_code": decision.error_code,
        "resolution": ADOPTED_RESOLUTION if terminal else None,
        "retention_seconds": int(new.retention.total_seconds()),
        # The effect proves that at least one attempt reached the provider.
        "possibly_sent": True,
        "attempts": 1,
        "checks": 0,
        "needs_attention": True,
        "lease_owner": None,
        "lease_expires_at": None,
        "version": 1,
        "created_at": db_now(),
        "updated_at": db_now(),
        "next_check_at": None if terminal else db_now(),
        "completed_at": db_now() if terminal else None,
        "retain_until": (
            db_now_plus(sa.literal(int(new.retention.total_seconds()))) if terminal else None
        ),
    }
    # The outbox hooks run whoever settles the operation (docs/outbox.md), as a transition
    # stages them; a released row adopted goes through Store.transition, which does so.
    hooks = staging(store.outbox_hooks, new.operation, state)
    insert = postgresql.insert if store.is_postgres else sqlite.insert
    stmt = (
        insert(operations)
        .values(**values)
        .on_conflict_do_nothing(index_elements=["tenant_id", "operation", "idempotency_key"])
        .returning(*operations.c)
    )

    def txn(conn: Connection) -> OperationRecord | None:
        row = conn.execute(stmt).mappings().first()
        if row is None:
            return None
        record = OperationRecord.from_row(row)
        add_event(
            conn,
            record,
            kind=ADOPTED_EVENT,
            actor=actor,
            from_state=None,
            to_state=state,
            detail=detail,
        )
        if hooks is not None:  # money moved: its messages commit with the outcome, or neither
            stage_settled(conn, hooks, record)
        return record

    return run_in_transaction(store.engine, txn)


def adopt_released(
    store: Store,
    record: OperationRecord,
    decision: Decision,
    *,
    provider_reference: str,
    actor: str,
    detail: Mapping[str, Any],
) -> OperationRecord:
    """Move ``record``, a released operation of the effect's namespace, to ``decision``'s
    state, flagged for attention, with its ``adopted`` event: one transition fenced by the
    version ``record`` was read at (``StaleVersion`` if anyone wrote it since).

    Its stored request is dropped, as an adoption from nothing has none: it was never sent,
    and the row's ``created_at`` is later than the effect's key, so a re-submission could
    fall outside the provider's idempotency window of the key (the reconciler re-submits
    only operations with a request). The caller keeps it in the event's detail.
    """
    terminal = decision.state.terminal
    return store.transition(
        record,
        decision.state,
        kind=ADOPTED_EVENT,
        actor=actor,
        detail=detail,
        provider_reference=provider_reference,
        response=decision.response,
        request=None,
        error_code=decision.error_code,
        resolution=ADOPTED_RESOLUTION if terminal else None,
        # The effect proves that at least one attempt reached the provider.
        possibly_sent=True,
        attempts_delta=1,
        needs_attention=True,
        # An outcome_unknown one is due for the reconciler's first check now.
        next_check_in=None if terminal else timedelta(0),
    )
