"""Orphans: settlement rows no operation explains, adopted as ``payorch effects`` adopts.

A row's ``payment_metadata[payorch_…]`` (or ``refund_metadata``) columns carry the tags
payorch put on the effect; with them, an orphan is the effect of a claim lost in a failover,
and adopting it gives its namespace the operation that claim would have become (flagged for
attention, with an ``adopted`` event holding the row), so the client's retry replays it
instead of charging again. A row without tags (an Adyen report names only the merchant
reference) cannot be adopted: it is listed for a human.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import sqlalchemy as sa

from ..core import is_namespace_key
from ..errors import InvalidRequest
from ..operations import Registry
from ..provider import AnswerKind, ProviderEffect
from ..reconciling import _unexplained as unexplained
from ..reconciling._findings import Finding, Verdict
from ..storage._engine import read_in_transaction
from ..storage._store import Store
from ..storage._tables import recon_rows
from . import _ledger as ledger
from ._judge import RowClass

__all__ = ["adopt_orphan", "effect_of", "refusal_of"]


def effect_of(row: Mapping[str, Any]) -> ProviderEffect:
    """A row as the effect a listing would show (for the adoption machinery)."""
    detail = row.get("detail") or {}
    tags = detail.get("tags") or {}
    return ProviderEffect(
        provider_reference=row["reference"] or row["row_key"],
        kind=AnswerKind.SUCCEEDED,
        amount=row["amount"],
        currency=row["currency"],
        created_at=row["booked_at"],
        tags={str(k): str(v) for k, v in tags.items()},
        object_type=f"settlement_{row['entry']}",
        raw={"settlement_row": row["row_key"], **(detail.get("raw") or {})},
    )


def refusal_of(row: Mapping[str, Any], key_scope: str | None = None) -> str | None:
    """Why an orphan row cannot be adopted; None if it can."""
    effect = effect_of(row)
    if not effect.ours:
        key = row.get("merchant_reference")
        if isinstance(key, str) and is_namespace_key(key):
            return (
                f"made under payorch's key {key} (a claim lost?), but the report names no "
                "namespace (no metadata columns): look it up with `payorch effects "
                "unexplained` where the provider lists its effects, or settle it by hand"
            )
        return "its row carries no payorch tags (no metadata columns): settle it by hand"
    return unexplained.adoption_refusal(effect, key_scope=key_scope)


def _row(store: Store, provider: str, account: str, key: str) -> dict[str, Any]:
    r = recon_rows.c
    query = sa.select(recon_rows).where(
        r.provider == provider, r.account == account, r.row_key == key
    )
    found = read_in_transaction(store.engine, lambda conn: conn.execute(query).mappings().first())
    if found is None:
        raise InvalidRequest(f"no settlement row {key!r} of {provider} (account {account!r})")
    return dict(found)


def adopt_orphan(
    store: Store,
    provider: str,
    key: str,
    *,
    account: str = "",
    actor: str,
    reason: str,
    registry: Registry | None = None,
    key_scope: str | None = None,
) -> Finding:
    """Adopt the orphan row ``key``: the finding as it ends (``ADOPTED``, or ``EXPLAINED``
    when a client's retry claimed the namespace first). ``InvalidRequest`` for a row that is
    not an orphan or cannot be adopted."""
    row = _row(store, provider, account, key)
    if row["class"] != RowClass.ORPHAN.value:
        raise InvalidRequest(f"settlement row {key!r} is {row['class'] or 'not judged yet'}")
    if (row.get("detail") or {}).get("adopted_as"):
        raise InvalidRequest(f"settlement row {key!r} was adopted already")
    refusal = refusal_of(row, key_scope)
    if refusal is not None:
        raise InvalidRequest(f"settlement row {key!r} cannot be adopted: {refusal}")
    effect = effect_of(row)
    finding = unexplained.explain(store, provider, effect, key_scope=key_scope)
    if finding.verdict is Verdict.UNEXPLAINED:
        finding = unexplained.adopt(
            store, finding, actor=actor, reason=reason, registry=registry, key_scope=key_scope
        )
    if finding.operation_id is not None:
        detail = {**(row.get("detail") or {}), "adopted_as": finding.operation_id}
        if finding.verdict is Verdict.EXPLAINED:
            detail["explained_by"] = finding.explained_by
        tenant = effect.tags.get("payorch_tenant_id")
        ledger.run(
            store,
            recon_rows.update()
            .where(
                recon_rows.c.provider == provider,
                recon_rows.c.account == account,
                recon_rows.c.row_key == key,
            )
            .values(detail=detail, tenant_id=tenant, operation_id=finding.operation_id),
        )
    return replace(finding)
