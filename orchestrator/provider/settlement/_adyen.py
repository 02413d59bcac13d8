"""Adyen's Settlement details report (``settlement_detail_report_batch_N.csv``).

One header line, then one line per journal entry of one settlement batch: ``Type`` says what
moved (``Settled``, ``Refunded``, ``Chargeback``, ``Fee``, ``MerchantPayout`` …), amounts are
decimals in major units, split into debit and credit columns, in the payment's currency
(``Gross … (GC)``) and the settlement's (``Net … (NC)``). ``MerchantPayout`` is the batch's
total, one per settlement currency, in ``Net Debit (NC)``: the credits less the debits of the
batch's other rows. Every row names its ``Merchant Account`` and ``Batch Number``.

The report has no row id: a row's key is its batch, type, references, time and amounts, and
its place among identical rows of the batch (a batch is reported whole, in one file).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from datetime import timezone

from iso4217 import Currency

from ._rows import Entry, ParsedReport, SettlementRow
from ._table import MAX_ACCOUNT, MAX_REFERENCE, Cells, Table, fixed_zone

__all__ = ["FORMAT", "adyen_exponent", "parse_adyen"]

FORMAT = "adyen"
REQUIRED = (
    "Merchant Account",
    "Psp Reference",
    "Merchant Reference",
    "Creation Date",
    "Type",
    "Modification Reference",
    "Gross Currency",
    "Gross Debit (GC)",
    "Gross Credit (GC)",
    "Net Currency",
    "Net Debit (NC)",
    "Net Credit (NC)",
    "Batch Number",
)
_FEES = ("Commission (NC)", "Markup (NC)", "Scheme Fees (NC)", "Interchange (NC)")
_ENTRIES = {
    "Settled": Entry.CAPTURE,
    "SettledBulk": Entry.CAPTURE,
    "Refunded": Entry.REFUND,
    "RefundedBulk": Entry.REFUND,
    "RefundedReversed": Entry.REFUND_REVERSAL,
    "Chargeback": Entry.CHARGEBACK,
    "SecondChargeback": Entry.CHARGEBACK,
    "ChargebackReversed": Entry.CHARGEBACK_REVERSAL,
    "MerchantPayout": Entry.PAYOUT,
}
# The abbreviations Adyen writes in ``TimeZone`` (the company account's zone), as offsets.
# One it does not list is read as UTC: a settlement day is matched, not a second.
_ZONES = {
    "UTC": 0, "GMT": 0, "WET": 0, "WEST": 1, "BST": 1, "IST": 1, "CET": 1, "CEST": 2,
    "MET": 1, "MEST": 2, "EET": 2, "EEST": 3, "MSK": 3, "GST": 4, "SGT": 8, "HKT": 8,
    "AWST": 8, "JST": 9, "KST": 9, "ACST": 9.5, "ACDT": 10.5, "AEST": 10, "AEDT": 11,
    "NZST": 12, "NZDT": 13, "BRT": -3, "ART": -3, "NST": -3.5, "AST": -4, "ADT": -3,
    "EST": -5, "EDT": -4, "CST": -6, "CDT": -5, "MST": -7, "MDT": -6, "PST": -8, "PDT": -7,
    "AKST": -9, "AKDT": -8, "HST": -10,
}  # fmt: skip


# Where Adyen's minor units differ from ISO 4217 (its currency codes page: "For CLP, CVE,
# IDR, and ISK the standard has a different number of decimals").
_ADYEN_EXPONENTS = {"CLP": 2, "CVE": 0, "IDR": 0, "ISK": 2}


def adyen_exponent(currency: str) -> int:
    """The digits after the point of ``currency`` in Adyen's minor units."""
    if currency in _ADYEN_EXPONENTS:
        return _ADYEN_EXPONENTS[currency]
    exponent = Currency(currency).exponent
    return 2 if exponent is None else exponent


def _zone(cells: Cells) -> timezone:
    name = (cells.text("TimeZone") or "UTC").upper()
    return fixed_zone(_ZONES.get(name, 0))


def _row(cells: Cells, occurrence: Counter[str]) -> SettlementRow:
    category = cells.required("Type")
    entry = _ENTRIES.get(category, Entry.OTHER)
    batch = str(cells.bounded("Batch Number", cells.required("Batch Number"), MAX_ACCOUNT))
    if not batch.isdigit():
        raise cells.refuse("Batch Number", f"{batch!r} is not a batch number")
    net_currency = cells.currency("Net Currency")
    if net_currency is None:
        raise cells.refuse("Net Currency", "empty, and every row needs it")
    net = cells.amount("Net Credit (NC)", net_currency, adyen_exponent) - cells.amount(
        "Net Debit (NC)", net_currency, adyen_exponent
    )
    currency = cells.currency("Gross Currency")
    amount: int | None = None
    if currency is not None and (cells.first("Gross Credit (GC)", "Gross Debit (GC)")):
        gross = cells.amount("Gross Credit (GC)", currency, adyen_exponent) - cells.amount(
            "Gross Debit (GC)", currency, adyen_exponent
        )
        amount = abs(gross)
    fees = [c for c in _FEES if cells.text(c) is not None]
    fee = sum(cells.amount(c, net_currency, adyen_exponent) for c in fees) if fees else None
    psp = cells.bounded("Psp Reference", cells.text("Psp Reference"), MAX_REFERENCE)
    modification = cells.bounded(
        "Modification Reference", cells.text("Modification Reference"), MAX_REFERENCE
    )
    ours = cells.bounded("Merchant Reference", cells.text("Merchant Reference"), MAX_REFERENCE)
    theirs = cells.bounded(
        "Modification Merchant Reference",
        cells.text("Modification Merchant Reference"),
        MAX_REFERENCE,
    )
    created_at = cells.time("Creation Date", _zone(cells))
    identity = "\x1f".join(
        [batch, category, psp or "", modification or "", net_currency, str(net), str(created_at)]
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:24]
    occurrence[digest] += 1
    if entry is Entry.REFUND:
        reference, merchant = modification, theirs
    elif entry is Entry.PAYOUT or entry is Entry.OTHER:
        reference, merchant = psp or modification, ours
    elif entry is Entry.CAPTURE:
        # A separate capture's own pspReference and reference (which its payment.capture
        # holds and sent); the payment's are matched as well.
        reference, merchant = modification or psp, theirs or ours
    else:
        reference, merchant = psp, ours
    return SettlementRow(
        line=cells.line,
        key=f"{batch}:{digest}:{occurrence[digest]}",
        entry=entry,
        category=category,
        account=cells.bounded("Merchant Account", cells.required("Merchant Account"), MAX_ACCOUNT),
        batch=batch,
        created_at=created_at,
        reference=reference,
        payment_reference=psp,
        merchant_reference=merchant,
        payment_merchant_reference=ours,
        tags={},
        amount=amount,
        currency=currency,
        net_currency=net_currency,
        net=net,
        fee=fee,
        raw=cells.present(),
    )


def parse_adyen(table: Table) -> ParsedReport:
    """``table`` as an Adyen Settlement details report; ``SettlementReportInvalid`` else."""
    table.require(REQUIRED, "an Adyen Settlement details report")
    occurrence: Counter[str] = Counter()
    rows = tuple(_row(cells, occurrence) for cells in table.cells())
    return ParsedReport(
        name=table.name,
        digest=table.digest,
        format=FORMAT,
        kind="settlement_details",
        account=table.one_account((r.account for r in rows), "Merchant Account"),
        rows=rows,
    )
