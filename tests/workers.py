"""Functions run in child processes by the race tests (importable by 'spawn')."""

from __future__ import annotations

import random
from datetime import timedelta

from orchestrator.errors import OperationInProgress
from orchestrator.records import NewOperation
from orchestrator.store import Store


def claim_many(url: str, worker: int, keys: list[str]) -> list[tuple[str, str, bool]]:
    """Claim every key (in a worker-specific order); report (key, operation id, created)."""
    store = Store.from_url(url)
    order = list(keys)
    random.Random(worker).shuffle(order)
    out: list[tuple[str, str, bool]] = []
    try:
        for key in order:
            new = NewOperation(
                tenant_id="race",
                operation="payment.create",
                idempotency_key=key,
                fingerprint="f" * 64,
                provider="sandbox",
            )
            try:
                res = store.claim(new, owner=f"worker-{worker}", lease=timedelta(seconds=60))
                out.append((key, res.operation.id, res.created))
            except OperationInProgress as exc:
                assert exc.operation_id is not None
                out.append((key, exc.operation_id, False))
    finally:
        store.close()
    return out
