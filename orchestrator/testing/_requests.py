"""Requests as payorch's executor builds them, for the adapter kit and adapter authors.

The namespace is validated and fingerprinted by the operation's registry entry, the
downstream key comes from the namespace alone (``downstream_key(namespace_ref(…))``), and the
payorch tags follow from both: the request an adapter meets in production.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from ..operations import Registry, default_registry
from ..provider import StatusQuery, SubmitRequest, VoidRequest

__all__ = ["KIT_TENANT", "status_query", "submit_request", "void_request"]

KIT_TENANT = "t_kit"


def submit_request(
    payload: dict[str, Any],
    *,
    operation: str = "payment.create",
    idempotency_key: str | None = None,
    tenant_id: str = KIT_TENANT,
    registry: Registry | None = None,
) -> SubmitRequest:
    """The request payorch sends for ``payload`` under the client's ``idempotency_key``
    (a fresh one when None): validated, fingerprinted, keyed from the namespace."""
    key = idempotency_key if idempotency_key is not None else f"kit-{uuid.uuid4().hex}"
    prepared = (registry or default_registry(provider="kit")).prepare(
        tenant_id=tenant_id, operation=operation, idempotency_key=key, request=payload
    )
    new = prepared.new
    return SubmitRequest(
        tenant_id=new.tenant_id,
        operation=new.operation,
        operation_id=str(uuid.uuid4()),
        downstream_key=new.downstream_key,
        payload=dict(prepared.payload),
        idempotency_key=new.idempotency_key,
        fingerprint=new.fingerprint,
    )


def status_query(request: SubmitRequest, provider_reference: str | None = None) -> StatusQuery:
    """The reconciler's status query for ``request`` (by reference when one is given)."""
    return StatusQuery(
        tenant_id=request.tenant_id,
        operation=request.operation,
        operation_id=request.operation_id,
        downstream_key=request.downstream_key,
        provider_reference=provider_reference,
        payload=request.payload,
        idempotency_key=request.idempotency_key,
        fingerprint=request.fingerprint,
    )


def void_request(
    request: SubmitRequest,
    provider_reference: str | None = None,
    *,
    reason: str = "adapter kit: void past the deadline",
    actor: str = "adapter-kit",
) -> VoidRequest:
    """The void of what ``request`` may have authorised (its ``void_key`` from the key)."""
    query = status_query(request, provider_reference)
    named = {f.name: getattr(query, f.name) for f in dataclasses.fields(query)}
    return VoidRequest(**named, reason=reason, actor=actor)
