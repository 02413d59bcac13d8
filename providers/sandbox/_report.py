"""The sandbox's ledger as a settlement report, in Stripe's itemized format or Adyen's
Settlement details format (``SandboxServer.settlement_report``), so tests and the demo
reconcile end to end.

What a settlement shows is money that moved: a succeeded ``payment.create`` captured at once,
a succeeded ``payment.capture`` (its effect is the capture of an authorisation), a succeeded
``refund.create``. Declined, voided and processing effects, and authorisations not captured,
settle nothing. Each row names the effect as payorch stored it (its ``sbx_…`` id), its
payment (a refund's or capture's ``payment_intent``), the key it was made under (Adyen's
merchant reference) and its payorch tags (Stripe's metadata columns).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from datetime import UTC, datetime
from typing import Any

from ...provider.settlement import Entry, ReportEntry, write_adyen_settlement, write_stripe_itemized

__all__ = ["MERCHANT_ACCOUNT", "settlement_report"]

MERCHANT_ACCOUNT = "SandboxMerchant"


def _entry(
    effect: Mapping[str, Any],
    payments: Mapping[str, Mapping[str, Any]],
    fee: Callable[[int], int],
    batch: str,
) -> ReportEntry | None:
    if effect.get("status") != "succeeded":
        return None
    operation = str(effect.get("operation"))
    payment = effect.get("payment_intent")
    captured = operation == "payment.create" and effect.get("capture_method") != "manual"
    if captured or operation == "payment.capture":
        kind = Entry.CAPTURE
    elif operation.startswith("refund."):
        kind = Entry.REFUND
    else:
        return None
    # A capture or refund of the whole payment names no amount: the payment's.
    paid = payments.get(payment) if isinstance(payment, str) else None
    amount = effect.get("amount_to_capture") or effect.get("amount")
    currency = effect.get("currency")
    if paid is not None:
        amount = amount or paid.get("amount")
        currency = currency or paid.get("currency")
    if not isinstance(amount, int) or not isinstance(currency, str):
        return None
    metadata = effect.get("metadata") or {}
    return ReportEntry(
        entry=kind,
        reference=str(effect["id"]),
        amount=amount,
        currency=currency,
        created_at=datetime.fromtimestamp(int(effect["created"]), UTC),
        payment_reference=payment if isinstance(payment, str) else None,
        merchant_reference=str(effect.get("idempotency_key") or ""),
        payment_merchant_reference=paid.get("idempotency_key") if paid is not None else None,
        fee=fee(amount) if kind is Entry.CAPTURE else 0,
        tags={k: v for k, v in metadata.items() if k.startswith("payorch_")},
        # A Stripe payout is in one currency: one per currency of the batch.
        batch=f"{batch}_{currency.lower()}" if batch.startswith("po_") else batch,
    )


def settlement_report(
    ledger: list[dict[str, Any]],
    *,
    format: str = "stripe",
    batch: str | int = 1,
    fee: Callable[[int], int] | None = None,
    effects: Collection[str] | None = None,
) -> bytes:
    """``ledger`` (the sandbox's effects) as one batch of a settlement report (``effects``:
    only these ids)."""
    charge = fee or (lambda _amount: 0)
    label = f"po_sandbox_{batch}" if format == "stripe" else str(batch)
    payments = {str(e["id"]): e for e in ledger}
    entries = [
        entry
        for effect in ledger
        if effects is None or effect["id"] in effects
        if (entry := _entry(effect, payments, charge, label)) is not None
    ]
    if format == "stripe":
        return write_stripe_itemized(entries)
    if format == "adyen":
        return write_adyen_settlement(entries, merchant_account=MERCHANT_ACCOUNT, batch=int(batch))
    raise ValueError(f"unknown report format {format!r}: stripe or adyen")
