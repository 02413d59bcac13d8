"""Requests and status queries as the executor makes them, shared by the sandbox adapter's
tests."""

from __future__ import annotations

from typing import Any

from payorch.core import downstream_key, namespace_ref
from payorch.provider import StatusQuery, SubmitRequest


def key_of(idempotency_key: str) -> str:
    """The downstream key payorch sends for the client's key (from the namespace)."""
    return downstream_key(namespace_ref("t_1", "payment.create", idempotency_key))


DK_1 = key_of("order-1")


def request(key: str = "order-1", operation_id: str = "op_1", **payload: Any) -> SubmitRequest:
    """A request as the executor makes it for the client's ``key``."""
    body: dict[str, Any] = {
        "amount": 1250,
        "currency": "EUR",
        "customer": "cus_1",
        "payment_method": "pm_card_visa",
    }
    body.update(payload)
    return SubmitRequest(
        tenant_id="t_1",
        operation="payment.create",
        operation_id=operation_id,
        downstream_key=key_of(key),
        payload=body,
        idempotency_key=key,
        fingerprint="f" * 64,
    )


def query(key: str = "order-1", reference: str | None = None) -> StatusQuery:
    return StatusQuery(
        tenant_id="t_1",
        operation="payment.create",
        operation_id="op_1",
        downstream_key=key_of(key),
        provider_reference=reference,
        idempotency_key=key,
        fingerprint="f" * 64,
    )
