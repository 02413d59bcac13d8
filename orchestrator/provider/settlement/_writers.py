"""Writing settlement reports in the providers' formats, for emulators, tests and demos.

The emulators (the sandbox, the Stripe-shaped and the Adyen-shaped one) turn their ledgers
into :class:`ReportEntry` values and write them with :func:`write_stripe_itemized` or
:func:`write_adyen_settlement`, as the provider would report them: so an end-to-end test
imports the file the provider would hand the merchant, and the parsers read what the writers
write.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from ._adyen import adyen_exponent
from ._rows import Entry
from ._stripe import stripe_exponent

__all__ = ["ADYEN_HEADER", "ReportEntry", "write_adyen_settlement", "write_stripe_itemized"]

_TIME = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True, kw_only=True)
class ReportEntry:
    """One effect as a report shows it: a capture or a refund (``entry``), amounts in
    minor units, ``fee`` taken from it."""

    entry: Entry
    reference: str  # the effect's own id: ``pi_…``/``re_…``, a PSP reference
    amount: int
    currency: str
    created_at: datetime
    payment_reference: str | None = None  # a refund's payment (a capture: its reference)
    merchant_reference: str | None = None  # what the merchant sent as its reference
    payment_merchant_reference: str | None = None  # a refund's payment's merchant reference
    # A capture's own reference where it has one apart from its payment's (Adyen's
    # modification pspReference of a separate capture).
    capture_reference: str | None = None
    fee: int = 0
    tags: Mapping[str, str] = field(default_factory=dict)  # payorch_* metadata
    batch: str | None = None  # its payout's id (Stripe) / batch number (Adyen)


def _decimal(minor: int, exponent: int) -> str:
    return f"{Decimal(minor).scaleb(-exponent):.{exponent}f}"


def _id(prefix: str, *parts: object) -> str:
    return prefix + hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:24]


def write_stripe_itemized(
    entries: Iterable[ReportEntry], *, payouts: bool = True, metadata: Sequence[str] = ()
) -> bytes:
    """A Stripe ``payout_reconciliation.itemized`` report of ``entries``: one balance
    transaction per row, with ``payment_metadata[…]``/``refund_metadata[…]`` columns for
    ``metadata`` keys (default: every payorch tag the entries carry); with ``payouts``, a
    ``payout`` row per batch and currency, its total (negative: it leaves the balance)."""
    rows = list(entries)
    keys = list(metadata) or sorted({k for e in rows for k in e.tags})
    header = [
        "balance_transaction_id", "created_utc", "available_on_utc", "currency", "gross",
        "fee", "net", "reporting_category", "source_id", "description", "automatic_payout_id",
        "payment_intent_id",
        *(f"payment_metadata[{k}]" for k in keys),
        *(f"refund_metadata[{k}]" for k in keys),
    ]  # fmt: skip
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    totals: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], datetime] = {}
    paid: dict[tuple[str, str], list[str]] = {}
    for e in rows:
        exp = stripe_exponent(e.currency.upper())
        refund = e.entry is Entry.REFUND
        gross = -e.amount if refund else e.amount
        net = gross - e.fee
        if e.batch is not None:
            at = (e.batch, e.currency.lower())
            totals[at] = totals.get(at, 0) + net
            last[at] = max(last.get(at, e.created_at), e.created_at)
            paid.setdefault(at, []).append(e.reference)
        own = dict(e.tags) if not refund else {}
        theirs = dict(e.tags) if refund else {}
        writer.writerow(
            [
                _id("txn_", e.reference, e.entry.value),
                e.created_at.astimezone(UTC).strftime(_TIME),
                (e.created_at + timedelta(days=2)).astimezone(UTC).strftime(_TIME),
                e.currency.lower(),
                _decimal(gross, exp),
                _decimal(e.fee, exp),
                _decimal(net, exp),
                "refund" if refund else "charge",
                e.reference if refund else _id("ch_", e.reference),
                "REFUND FOR PAYMENT" if refund else "Payment",
                e.batch or "",
                e.payment_reference if refund else e.reference,
                *(own.get(k, "") for k in keys),
                *(theirs.get(k, "") for k in keys),
            ]
        )
    if payouts:
        for (batch, currency), total in sorted(totals.items()):
            exp = stripe_exponent(currency.upper())
            when = last[(batch, currency)] + timedelta(days=2)
            writer.writerow(
                [
                    _id("txn_", batch, currency, "payout", *sorted(paid[(batch, currency)])),
                    when.astimezone(UTC).strftime(_TIME),
                    when.astimezone(UTC).strftime(_TIME),
                    currency,
                    _decimal(-total, exp),
                    _decimal(0, exp),
                    _decimal(-total, exp),
                    "payout",
                    batch,
                    "STRIPE PAYOUT",
                    batch,
                    "",
                    *([""] * (2 * len(keys))),
                ]
            )
    return out.getvalue().encode()


ADYEN_HEADER = (
    "Company Account", "Merchant Account", "Psp Reference", "Merchant Reference",
    "Payment Method", "Creation Date", "TimeZone", "Type", "Modification Reference",
    "Gross Currency", "Gross Debit (GC)", "Gross Credit (GC)", "Exchange Rate",
    "Net Currency", "Net Debit (NC)", "Net Credit (NC)", "Commission (NC)", "Markup (NC)",
    "Scheme Fees (NC)", "Interchange (NC)", "Payment Method Variant",
    "Modification Merchant Reference", "Batch Number", "Reserved4", "Reserved5",
    "Reserved6", "Reserved7", "Reserved8", "Reserved9", "Reserved10",
)  # fmt: skip


def write_adyen_settlement(
    entries: Iterable[ReportEntry],
    *,
    merchant_account: str,
    batch: int,
    company_account: str = "PayorchCompany",
    payout: bool = True,
) -> bytes:
    """Adyen's ``settlement_detail_report_batch_<batch>.csv`` of ``entries``: ``Settled``
    and ``Refunded`` rows, then (with ``payout``) a ``MerchantPayout`` per net currency,
    the batch's credits less its debits."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(ADYEN_HEADER)
    totals: dict[str, int] = {}
    last = datetime.fromtimestamp(0, UTC)
    for e in entries:
        currency = e.currency.upper()
        exp = adyen_exponent(currency)
        refund = e.entry is Entry.REFUND
        net = e.amount - e.fee
        totals[currency] = totals.get(currency, 0) + (-e.amount - e.fee if refund else net)
        last = max(last, e.created_at)
        psp = (e.payment_reference or e.reference) if refund else e.reference
        amount = _decimal(e.amount, exp)
        debit_net = _decimal(e.amount + e.fee, exp)
        writer.writerow(
            [
                company_account,
                merchant_account,
                psp,
                (e.payment_merchant_reference or "") if refund else (e.merchant_reference or ""),
                "visa",
                e.created_at.astimezone(UTC).strftime(_TIME),
                "UTC",
                "Refunded" if refund else "Settled",
                e.reference if refund else e.capture_reference or _id("", e.reference)[:16].upper(),
                currency,
                amount if refund else "",
                "" if refund else amount,
                "1",
                currency,
                debit_net if refund else "",
                "" if refund else _decimal(net, exp),
                _decimal(e.fee, exp) if e.fee else "",
                "",
                "",
                "",
                "visadebit",
                (e.merchant_reference or "") if refund else "",
                str(batch),
                *([""] * 7),
            ]
        )
    if payout:
        for currency, total in sorted(totals.items()):
            exp = adyen_exponent(currency)
            paid = _decimal(abs(total), exp)
            writer.writerow(
                [
                    company_account,
                    merchant_account,
                    "",
                    "",
                    "",
                    (last + timedelta(hours=1)).strftime(_TIME),
                    "UTC",
                    "MerchantPayout",
                    f"TX{_id('', batch, currency)[:10].upper()}XT batch {batch}, "
                    f"{merchant_account}",
                    "",
                    "",
                    "",
                    "",
                    currency,
                    paid if total >= 0 else "",
                    "" if total >= 0 else paid,
                    "", "", "", "", "", "",
                    str(batch),
                    *([""] * 7),
                ]
            )  # fmt: skip
    return out.getvalue().encode()
