"""The reconciler's re-send: the identical request again under its key, or nothing.

A replay (a provider that cannot be asked) or a re-submission ("not found" after the grace
period) is safe only while the provider's idempotency window covers the key, and only as
the identical request: the provider then answers the first outcome, or executes the one
request that never arrived. That is the wire request the claim kept
(:class:`payorch.provider.WireRequest`), handed to the adapter's ``submit`` to send byte
for byte whatever this process's settings say. An operation that kept none (its stored
request hides a sensitive value, it was claimed before wire requests were kept, or it kept
one for another key), or whose adapter here cannot send one as it is (no
:class:`payorch.provider.Resender`), is never re-sent: it escalates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa

from ..core import State
from ..errors import StaleVersion
from ..execution._executor import RetryPolicy, submit_and_record
from ..provider import Provider, Resender, WireRequest
from ..records import OperationRecord, Redactor
from ..storage._sent import sent_wire
from ..storage._store import Store
from ..storage._tables import db_now_plus, operations
from ._fallbacks import attempt_started, moved_on
from ._policy import ReconcilerPolicy
from ._voids import VOID_WANTED

__all__ = ["resend_if_covered"]


class Reconciler(Protocol):
    """What a re-send needs of the reconciler that runs it (``_reconciler.Reconciler``)."""

    store: Store
    policy: ReconcilerPolicy
    owner: str
    submit_retry: RetryPolicy

    @property
    def _write(self) -> Callable[..., OperationRecord]: ...

    @property
    def _reschedule(self) -> Callable[..., None]: ...


def resend_if_covered(
    rec: Reconciler,
    record: OperationRecord,
    now: datetime,
    provider: Provider,
    detail: dict[str, Any],
    *,
    kind: str,
    actor_kind: str,
    decision: str,
    age: timedelta | None = None,
) -> str:
    """Re-send (re-submit or replay) the request as first sent, under its key, while the
    provider's window still covers it; otherwise escalate, never re-sending."""
    window = provider.idempotency_window
    reason = None
    wire: WireRequest | None = None
    # Judge the window by the database clock now, not the batch's pick time: earlier
    # checks in the batch may have taken long. The UPDATE in _resend re-checks it.
    # A routed operation that moved on: its key at this provider is as old as the move.
    started = attempt_started(rec.store, record) if moved_on(record) else record.created_at
    if age is None or started != record.created_at:
        age = rec.store.db_time() - started
    if record.resolution in VOID_WANTED:
        reason = "a void of it was wanted: never re-sent"
    elif window is None:
        reason = "provider honours no idempotency key: never re-sent"
    elif age > window - rec.policy.window_margin:
        reason = "past the provider's idempotency window: re-sending could charge twice"
    elif (where := Redactor.redacted_at(record.request)) is not None:
        # What was stored is not what was sent (a sensitive value, at any depth, is the
        # placeholder): re-sending it would hand the provider "[redacted]".
        reason = (
            f"stored request is incomplete (redacted at {where}): cannot re-send the "
            "identical request; settle it from the provider's records"
        )
    elif not isinstance(provider, Resender):
        # Its submit would build the request again, from this process's settings.
        reason = (
            "this adapter cannot re-send a request as first sent (no wire_request): "
            "settle it from the provider's records"
        )
    elif (wire := sent_wire(rec.store.engine, record)) is None:
        # Built again here, it would carry this process's settings, not the app's.
        reason = (
            "the request as first sent was not kept: one built here could differ; "
            "settle it from the provider's records"
        )
    if reason is not None:
        detail["decision"] = f"escalate: {reason}"
        rec._reschedule(record, now, kind=kind, detail=detail, attention=True)
        return "escalated"
    assert window is not None and record.request is not None
    detail["decision"] = decision
    if wire is not None:
        detail["wire"] = "as first sent"
    return _resend(
        rec,
        record,
        now,
        provider,
        detail,
        payload=dict(record.request),  # checked above: the request as first sent
        wire=wire,
        window=window,
        actor_kind=actor_kind,
        started=started,
    )


def _resend(
    rec: Reconciler,
    record: OperationRecord,
    now: datetime,
    provider: Provider,
    detail: dict[str, Any],
    *,
    payload: Mapping[str, Any],
    wire: WireRequest | None,
    window: timedelta,
    actor_kind: str,
    started: datetime,
) -> str:
    """Send the request again under its key, while the window still covers it (the key
    was first sent at ``started``: the operation's creation, or its move to this provider).

    ``payload`` is the stored request, found whole by the caller (no placeholder); ``wire``
    the request the claim kept, sent as it is where there is one.
    """
    first_sent: Any = operations.c.created_at
    if started != record.created_at:
        first_sent = sa.literal(started, type_=operations.c.created_at.type)
    still_covered = first_sent > db_now_plus(
        sa.literal(-(window - rec.policy.window_margin).total_seconds())
    )
    try:
        moved = rec._write(
            record,
            State.IN_PROGRESS,
            kind="replay" if actor_kind == "replay" else "resubmit",
            actor=rec.owner,
            detail=detail,
            lease=rec.policy.lease,
            lease_owner=rec.owner,
            possibly_sent=True,
            attempts_delta=1,
            checks_delta=1,
            guard=still_covered,
        )
    except StaleVersion:
        if rec.store.get(record.tenant_id, record.id).version != record.version:
            raise  # someone else wrote it: a lost race
        # Unchanged, so the window guard refused: the window closed while we looked.
        detail["decision"] = "escalate: the key window closed before the re-send"
        rec._reschedule(record, now, kind="status_query", detail=detail, attention=True)
        return "escalated"
    final = submit_and_record(
        rec.store,
        provider,
        moved,
        payload,
        owner=rec.owner,
        lease=rec.policy.lease,
        retry=rec.submit_retry,
        actor_kind=actor_kind,
        not_sent_is_final=False,
        wire=wire,
    )
    verb = "replayed" if actor_kind == "replay" else "resubmitted"
    return f"{verb}_{final.state.value}"
