"""The Adyen emulator's ledger as Adyen's Settlement details report
(``AdyenEmulator.settlement_report``), so a test imports what Adyen would hand the merchant.

A report shows money that moved: a captured payment (at once, or by a capture: its captured
amount) as ``Settled`` and a refund that succeeded (its REFUND notification says so) as
``Refunded``. Refused, cancelled and uncaptured payments moved nothing. Rows are named as
Adyen names them: a ``Settled`` row by the payment's pspReference and ``reference`` (what
payorch stores for payment.create) and, in its Modification Reference, the capture's own
pspReference (what payment.capture stores) when a capture request made it; a ``Refunded``
row by the refund's pspReference (what refund.create stores) and the refund request's
``reference``, with its payment's. The report has no metadata: no payorch tags.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from ...provider.settlement import Entry, ReportEntry, write_adyen_settlement

__all__ = ["Effect", "settlement_report"]


class Effect(Protocol):
    """What the report reads of the emulator's ledger entry (its ``_Effect``)."""

    kind: str
    psp: str
    reference: str | None
    amount: dict[str, Any] | None
    status: str
    payment: str | None
    captured: int
    created: datetime


def _refunded(items: Iterable[Mapping[str, Any]]) -> set[str]:
    """The pspReferences of the refunds whose REFUND notification says they succeeded."""
    return {
        str(i["pspReference"])
        for i in items
        if i.get("eventCode") == "REFUND" and i.get("success") == "true"
    }


def _entries(
    effects: Sequence[Effect],
    items: Iterable[Mapping[str, Any]],
    fee: Callable[[int], int],
    batch: str,
) -> list[ReportEntry]:
    payments = {e.psp: e for e in effects if e.kind == "payment"}
    captures = {e.payment: e.psp for e in effects if e.kind == "capture" and e.payment}
    refunded = _refunded(items)
    entries: list[ReportEntry] = []
    for e in effects:
        currency = str((e.amount or {}).get("currency", ""))
        if e.kind == "payment" and e.status == "captured" and e.captured > 0:
            entries.append(
                ReportEntry(
                    entry=Entry.CAPTURE,
                    reference=e.psp,
                    amount=e.captured,
                    currency=currency,
                    created_at=e.created,
                    payment_reference=e.psp,
                    merchant_reference=e.reference,
                    capture_reference=captures.get(e.psp),
                    fee=fee(e.captured),
                    batch=batch,
                )
            )
        elif e.kind == "refund" and e.psp in refunded and e.amount is not None:
            paid = payments.get(e.payment or "")
            entries.append(
                ReportEntry(
                    entry=Entry.REFUND,
                    reference=e.psp,
                    amount=int(e.amount["value"]),
                    currency=currency,
                    created_at=e.created,
                    payment_reference=e.payment,
                    merchant_reference=e.reference,
                    payment_merchant_reference=paid.reference if paid is not None else None,
                    batch=batch,
                )
            )
    return entries


def settlement_report(
    effects: Sequence[Effect],
    items: Iterable[Mapping[str, Any]],
    *,
    merchant_account: str,
    batch: str | int = 1,
    fee: Callable[[int], int] | None = None,
    only: Collection[str] | None = None,
) -> bytes:
    """The captured payments and succeeded refunds among ``effects`` (``items``: the
    notifications, which say which refunds succeeded) as one settlement batch of
    ``merchant_account``, its ``MerchantPayout`` included (``fee``: per captured amount;
    ``only``: only these pspReferences)."""
    number = int(batch)
    entries = _entries(effects, items, fee or (lambda _amount: 0), str(number))
    return write_adyen_settlement(
        (e for e in entries if only is None or e.reference in only),
        merchant_account=merchant_account,
        batch=number,
    )
