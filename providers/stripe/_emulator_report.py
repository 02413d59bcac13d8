"""The Stripe emulator's ledger as Stripe's itemized payout reconciliation report
(``StripeEmulator.settlement_report``), so a test imports what Stripe would hand the merchant.

A report shows money that moved: a PaymentIntent that succeeded (captured at once, or a
manual-capture one once captured: its ``amount_received``) and a refund that succeeded.
Declined, canceled and uncaptured intents moved nothing. Each row names its effect by the id
payorch's adapter stores for it, ``pi_…`` for a payment (created or captured) and ``re_…``
for a refund, with the object's payorch tags in the metadata columns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from ...provider.settlement import Entry, ReportEntry, write_stripe_itemized

__all__ = ["payout_id", "settlement_report"]


def payout_id(batch: str | int) -> str:
    """The payout a batch is paid out in: a number names ``po_emulator_<n>``."""
    return f"po_emulator_{batch}" if isinstance(batch, int) else batch


def _tags(obj: Mapping[str, Any]) -> dict[str, str]:
    metadata: Mapping[str, str] = obj.get("metadata") or {}
    return {k: v for k, v in metadata.items() if k.startswith("payorch_")}


def _when(obj: Mapping[str, Any]) -> datetime:
    return datetime.fromtimestamp(int(obj["created"]), UTC)


def _entries(
    intents: Iterable[Mapping[str, Any]],
    refunds: Iterable[Mapping[str, Any]],
    fee: Callable[[int], int],
    batch: str,
) -> list[ReportEntry]:
    entries = [
        ReportEntry(
            entry=Entry.CAPTURE,
            reference=pi["id"],
            amount=pi["amount_received"],
            currency=pi["currency"],
            created_at=_when(pi),
            payment_reference=pi["id"],
            fee=fee(pi["amount_received"]),
            tags=_tags(pi),
            batch=batch,
        )
        for pi in intents
        if pi["status"] == "succeeded" and pi["amount_received"] > 0
    ]
    entries += [
        ReportEntry(
            entry=Entry.REFUND,
            reference=refund["id"],
            amount=refund["amount"],
            currency=refund["currency"],
            created_at=_when(refund),
            payment_reference=refund["payment_intent"],
            tags=_tags(refund),
            batch=batch,
        )
        for refund in refunds
        if refund["status"] == "succeeded"
    ]
    # Booked in time order; a payment before its refund booked in the same second.
    return sorted(entries, key=lambda e: e.created_at)


def settlement_report(
    intents: Iterable[Mapping[str, Any]],
    refunds: Iterable[Mapping[str, Any]],
    *,
    batch: str | int = "po_emulator_1",
    fee: Callable[[int], int] | None = None,
    effects: Collection[str] | None = None,
) -> bytes:
    """The captures among ``intents`` and the ``refunds`` as one payout's itemized report,
    its ``payout`` row included (``fee``: per captured amount; ``effects``: only these
    ``pi_…``/``re_…`` ids)."""
    entries = _entries(intents, refunds, fee or (lambda _amount: 0), payout_id(batch))
    return write_stripe_itemized(e for e in entries if effects is None or e.reference in effects)
