"""The reconciler's move of a routed operation to its next provider, on proof found after
the executor let go: "not found" under the current attempt's key past its provider's
idempotency window (with no notification: it is still unknown), or a void the provider
confirmed. The request is sent there as the app's adapter builds it from the stored request
(whole, never with a redacted placeholder), under that provider's own downstream key.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol

from ..core import State
from ..execution._attempts import built_wire
from ..execution._executor import RetryPolicy, submit_and_record
from ..observing import _routing as routing_metrics
from ..provider import Provider, SubmitRequest
from ..records import OperationRecord, Redactor
from ..routing import Proof, attempts_of, key_at, moved, next_provider, touched
from ..storage import _route_keys as route_keys
from ..storage._store import Store
from ._cross_flags import is_cross_flag
from ._policy import ReconcilerPolicy

__all__ = ["attempt_age", "attempt_started", "fall_over", "moved_on", "past_window"]


class Reconciler(Protocol):
    """What a move needs of the reconciler that runs it (``_reconciler.Reconciler``): its
    store, policy, owner, adapters, re-send retries, and its logged, fenced write."""

    store: Store
    policy: ReconcilerPolicy
    owner: str
    submit_retry: RetryPolicy
    providers: dict[str, Provider]

    @property
    def _write(self) -> Callable[..., OperationRecord]: ...


def moved_on(record: OperationRecord) -> bool:
    """Whether ``record`` is a routed operation that moved to another provider."""
    return len(touched(record.route)) > 1


def attempt_age(store: Store, record: OperationRecord, now: datetime) -> timedelta:
    """How long ``record``'s current attempt has been under way by ``now``."""
    return now - (attempt_started(store, record) if moved_on(record) else record.created_at)


def attempt_started(store: Store, record: OperationRecord) -> datetime:
    """When ``record``'s current attempt began (the database clock): its last move to this
    provider, else its creation. A window is the key's, at that provider."""
    moves = [
        e.created_at
        for e in store.events(record.tenant_id, record.id)
        if e.kind == "fallback" and (e.detail or {}).get("to_provider") == record.provider
    ]
    return max(moves, default=record.created_at)


def past_window(
    rec: Reconciler, record: OperationRecord, provider: Provider, now: datetime
) -> bool:
    """Whether the current attempt's key is past its provider's idempotency window (a
    provider with none never is: its "not found" proves nothing about a later arrival)."""
    window = provider.idempotency_window
    if window is None:
        return False
    return now - attempt_started(rec.store, record) > window + rec.policy.window_margin


def fall_over(
    rec: Reconciler,
    record: OperationRecord,
    *,
    proof: Proof,
    detail: dict[str, Any],
    code: str | None = None,
) -> str | None:
    """Move ``record`` to its route's next provider and send it there; None (nothing
    written) when it is not routed, its route is spent, or its stored request is not whole."""
    if record.route is None or record.request is None:
        return None
    if Redactor.redacted_at(record.request) is not None:
        return None  # the stored request is not what the app would send
    if _duplicate_known(rec.store, record):
        # Money already moved at two providers: a third is no answer. A human decides.
        return None
    visited = {a["provider"] for a in attempts_of(record.route)}
    to = next_provider(record.route, visited, rec.providers)
    key = key_at(record.route, to) if to is not None else None
    if to is None or key is None:
        return None
    adapter = rec.providers[to]
    payload = dict(record.request)
    wire = built_wire(
        adapter,
        SubmitRequest(
            tenant_id=record.tenant_id,
            operation=record.operation,
            operation_id="",  # not sent: the namespace's key and tags carry no per-claim id
            downstream_key=key,
            payload=payload,
            idempotency_key=record.idempotency_key,
            fingerprint=record.fingerprint,
        ),
    )
    detail.update(
        decision=f"proven not executed ({proof.value}): move to {to}",
        proof=proof.value,
        from_provider=record.provider,
        from_key=record.downstream_key,  # what the left provider's webhooks and reports name
        to_provider=to,
        to_key=key,
    )
    if wire is not None:
        detail["wire"] = wire.stored()
    moving = rec._write(
        record,
        State.IN_PROGRESS,
        kind="fallback",
        actor=rec.owner,
        detail=detail,
        lease=rec.policy.lease,
        lease_owner=rec.owner,
        possibly_sent=True,
        attempts_delta=1,
        checks_delta=1,
        provider=to,
        downstream_key=key,
        # The key it leaves behind: that provider's webhooks and reports name it.
        also=route_keys.remember(rec.store, [(record.provider, record.downstream_key)]),
        route=moved(
            record.route,
            proof=proof,
            code=code,
            to=to,
            key=key,
            reference=record.provider_reference,
        ),
        moved_on=True,
        # The attempt left is done with: a void wanted of it is not the next one's.
        resolution=None,
    )
    routing_metrics.fell_back(record.provider, to, proof.value)
    routing_metrics.attempted(to)
    final = submit_and_record(
        rec.store,
        adapter,
        moving,
        payload,
        owner=rec.owner,
        lease=rec.policy.lease,
        retry=rec.submit_retry,
        actor_kind="fallback_submission",
        not_sent_is_final=False,  # an unsent move stays unknown, looked at again
        wire=wire,
    )
    return f"fell_back_{final.state.value}"


def _duplicate_known(store: Store, record: OperationRecord) -> bool:
    # A settlement row's or a webhook's flag counts as much as the look's own.
    return any(is_cross_flag(e) for e in store.events(record.tenant_id, record.id))
