"""The operator's side of payorch.once: find effects, list the escalated ones, and settle
one by an audited decision.

An escalated effect (``outcome_unknown``, ``needs_attention``) is never run again by
payorch: someone must find out whether it happened (the email provider's log, the other
ledger) and say so. :func:`resolve` records that decision, fenced by version and refused
while a live lease holds the effect; the decision (actor, reason) is kept on the row, in
``error["resolution"]``, beside what was known before. A resolution is final: the key's
later calls replay it (the result, or ``EffectFailed``).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from ..core import State
from ..errors import (
    InvalidRequest,
    InvalidTransition,
    OperationInProgress,
    OperationNotFound,
    StaleVersion,
    UnencodableRequest,
)
from ..observing._logs import emit
from ..storage._store import Store
from . import _sql as sql
from ._flow import log
from ._rules import MAX_ERROR_MESSAGE, storable
from ._values import DEFAULT_RETENTION, EffectRecord

__all__ = ["MAX_PAGE", "RESOLUTION_TYPE", "escalated", "find", "get", "resolve"]

MAX_PAGE = 1000
MAX_ACTOR = 200
RESOLUTION_TYPE = "OperatorResolution"  # EffectFailed.error_type of an operator's failure


def get(store: Store, *, tenant_id: str, namespace: str, key: str) -> EffectRecord:
    """The effect under (tenant, namespace, key); ``OperationNotFound`` if none."""
    found = sql.read_row(store, tenant_id, namespace, key)
    if found is None:
        raise OperationNotFound(f"no effect under that key in namespace {namespace!r}")
    return found[0]


def find(store: Store, effect_id: str, *, tenant_id: str | None = None) -> EffectRecord:
    """The effect with this id; without a tenant, looked up across tenants."""
    rows = sql.find_rows(store, effect_id, tenant_id)
    if not rows:
        raise OperationNotFound(f"no effect {effect_id}", operation_id=effect_id)
    if len(rows) > 1:
        raise InvalidRequest(f"effect id {effect_id} exists in several tenants: name the tenant")
    return rows[0]


def escalated(
    store: Store,
    *,
    tenant_id: str | None = None,
    namespace: str | None = None,
    limit: int = 100,
) -> list[EffectRecord]:
    """Effects waiting for an operator (``needs_attention``), oldest first."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be 1-{MAX_PAGE}")
    return sql.flagged(store, tenant_id=tenant_id, namespace=namespace, limit=limit)


def _text(name: str, value: object, limit: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{name} is required: who decided, and why, is the audit")
    if len(value) > limit:
        raise InvalidRequest(f"{name} is longer than {limit} characters")
    return value


def resolve(
    store: Store,
    effect_id: str,
    *,
    to: State | str,
    actor: str,
    reason: str,
    result: Any = None,
    tenant_id: str | None = None,
    expected_version: int | None = None,
    retention: timedelta = DEFAULT_RETENTION,
) -> EffectRecord:
    """Settle an escalated (or abandoned) effect: ``succeeded`` with ``result`` (what later
    calls replay), or ``failed_final`` (later calls raise ``EffectFailed`` with the reason).

    Only ``outcome_unknown``, or ``in_progress`` whose lease lapsed; a live lease raises
    ``OperationInProgress``, a settled effect ``InvalidTransition``. ``expected_version``
    (what the operator looked at) makes a change since then a ``StaleVersion``.
    """
    target = State(to)
    if not target.terminal:
        raise InvalidRequest("an effect is resolved as succeeded or failed_final")
    who = _text("actor", actor, MAX_ACTOR)
    why = _text("reason", reason, MAX_ERROR_MESSAGE)
    stored = None
    if target is State.SUCCEEDED:
        try:
            stored = storable(result)
        except (UnencodableRequest, TypeError, ValueError) as exc:
            raise UnencodableRequest(f"the result must be JSON: {exc}") from None
    first = find(store, effect_id, tenant_id=tenant_id)
    found = sql.read_row(store, first.tenant_id, first.namespace, first.key)
    if found is None or found[0].id != effect_id:
        raise OperationNotFound(f"no effect {effect_id}", operation_id=effect_id)
    record, now = found
    if expected_version is not None and record.version != expected_version:
        raise StaleVersion(
            f"effect {record.id} changed since version {expected_version}",
            operation_id=record.id,
        )
    _check_resolvable(record, now)
    audit = {"actor": who, "reason": why, "to": target.value, "from": record.state.value}
    if target is State.SUCCEEDED:
        values: dict[str, Any] = {
            "result": stored,
            "error": {"resolution": audit, "previous": record.error},
        }
    else:
        values = {
            "result": None,
            "error": {
                "kind": "operator",
                "type": RESOLUTION_TYPE,
                "message": why,
                "resolution": audit,
                "previous": record.error,
            },
        }
    values.update(state=target.value, needs_attention=False)
    try:
        done = sql.update_row(
            store, record, values, terminal=True, retention=retention, lapsed=True
        )
    except StaleVersion:
        # Lost to a writer that came after our read, or a lease taken meanwhile.
        raise StaleVersion(
            f"effect {record.id} changed while it was being resolved: look again",
            operation_id=record.id,
        ) from None
    emit(
        log,
        logging.INFO,
        "effect.resolved",
        effect_id=done.id,
        tenant_id=done.tenant_id,
        namespace=done.namespace,
        state=done.state.value,
        actor=who,
    )
    return done


def _check_resolvable(record: EffectRecord, now: datetime) -> None:
    if record.terminal:
        raise InvalidTransition(
            f"effect {record.id} is {record.state.value} already: settled effects are not rewritten"
        )
    lease = record.lease_expires_at
    if record.state is State.IN_PROGRESS and lease is not None and lease > now:
        raise OperationInProgress(
            f"effect {record.id} is running (its lease is live): resolve it once it lapses",
            operation_id=record.id,
            retry_after=max(1.0, round((lease - now).total_seconds(), 1)),
        )
