"""How a claim answers what it found, as plain functions over records (no I/O)."""

from __future__ import annotations

from typing import Any

from ..errors import CommitUncertain
from ..records import NewOperation, OperationRecord

__all__ = [
    "IN_PROGRESS_RETRY_CAP",
    "claim_detail",
    "claim_uncertain",
    "duplicate_kind",
    "look_again_after",
]

# "In progress" tells a client when to look again, not how long the lease lasts: the lease
# bounds the whole call with every inline retry (minutes with Stripe's time-outs). Look again
# after about as long as the attempt has run so far (a quick call is over soon, a slow one
# is likely to stay slow), at least 1 s, at most this, and not past a live lease's expiry.
IN_PROGRESS_RETRY_CAP = 5.0


def look_again_after(record: OperationRecord, lease_remaining: float) -> float:
    """Seconds an ``OperationInProgress`` asks the client to wait (``Retry-After``)."""
    if record.lease_expires_at is None:
        return 1.0
    # now = lease_expires_at - lease_remaining (the database's clock), so the time since the
    # operation's last write is (lease_expires_at - updated_at) - lease_remaining.
    ran = (record.lease_expires_at - record.updated_at).total_seconds() - lease_remaining
    wait = min(ran, IN_PROGRESS_RETRY_CAP)
    if lease_remaining > 0:
        wait = min(wait, lease_remaining)
    return max(1.0, round(wait, 1))


def claim_uncertain(new: NewOperation, op_id: str) -> CommitUncertain:
    # Our claim may be durable: the operation may exist, and the reconciler may send it.
    # Only a retry with the same key can tell, never a new key.
    return CommitUncertain(
        f"the claim of idempotency key {new.idempotency_key!r} may have committed "
        f"as operation {op_id}; retry with the same key later",
        operation_id=op_id,
        retry_after=1.0,
    )


def duplicate_kind(existing: OperationRecord, new: NewOperation) -> str | None:
    if existing.reaped_at is not None:
        return "expired_key_used"
    if existing.fingerprint != new.fingerprint:
        return "key_reused"
    if existing.terminal:
        return "replayed"
    return None


def claim_detail(new: NewOperation, **extra: Any) -> dict[str, Any]:
    """The ``claimed`` (or ``reclaimed``) event's detail: ``extra``, the namespace's key and
    fingerprint, and the request the adapter will send, when it said (a ``WireRequest``)."""
    detail = {**extra, "idempotency_key": new.idempotency_key, "fingerprint": new.fingerprint}
    if new.wire is not None:
        detail["wire"] = dict(new.wire)
    return detail
