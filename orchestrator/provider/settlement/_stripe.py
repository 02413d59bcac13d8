"""Stripe's itemized reports: balance change from activity, payout reconciliation, payouts.

One row per balance transaction (``balance_transaction_id``, unique: the row's key), amounts
as decimals in major units of ``currency`` (the balance's), ``reporting_category`` saying what
moved. Stripe lets users choose and order the columns; the ones read here:

======================================  =====================================================
``balance_transaction_id``              required: the row's key
``reporting_category``                  required: ``charge``, ``refund``, ``payout`` …
``currency``, ``gross``, ``net``        required; ``fee`` optional
``created_utc`` (or ``created``,        required, one of them: when Stripe booked it
``effective_at_utc``, ``effective_at``)
``payment_intent_id``, ``charge_id``    the payment (``pi_…`` is what payorch stores)
``source_id``                           the object moved: ``re_…`` for a refund, ``po_…``
``automatic_payout_id`` / ``payout_id`` the payout the row is in: its batch
``customer_facing_amount``/``_currency`` what the customer was charged, when it differs
``payment_metadata[payorch_…]``         payorch's tags on the payment (``refund_metadata``
                                        for a refund's)
``connected_account``                   Connect reports: the account the line belongs to
======================================  =====================================================

A ``payout`` row (in a payouts report) is its batch's total: the payout's balance
transaction, negative as the money leaves the balance.
"""

from __future__ import annotations

import re
from datetime import UTC

from ...errors import SettlementReportInvalid
from ._rows import Entry, ParsedReport, SettlementRow
from ._table import MAX_ACCOUNT, MAX_KEY, MAX_REFERENCE, Cells, Table

__all__ = ["FORMAT", "parse_stripe", "stripe_exponent"]

FORMAT = "stripe"
REQUIRED = ("balance_transaction_id", "reporting_category", "currency", "gross", "net")
TIMES = ("created_utc", "created", "effective_at_utc", "effective_at")

# Stripe's documented exceptions to two decimals in its API's minor units (its "zero-decimal"
# and "three-decimal" currencies): amounts payorch stored were sent in these units.
_ZERO = frozenset(
    ("BIF", "CLP", "DJF", "GNF", "JPY", "KMF", "KRW", "MGA", "PYG", "RWF", "UGX", "VND", "VUV",
     "XAF", "XOF", "XPF")
)  # fmt: skip
_THREE = frozenset(("BHD", "JOD", "KWD", "OMR", "TND"))

_ENTRIES = {
    "charge": Entry.CAPTURE,
    "refund": Entry.REFUND,
    "refund_failure": Entry.REFUND_REVERSAL,
    "dispute": Entry.CHARGEBACK,
    "dispute_reversal": Entry.CHARGEBACK_REVERSAL,
    "payout": Entry.PAYOUT,
}
_META = re.compile(r"(payment|refund)_metadata\[(payorch_[A-Za-z0-9_]+)\]")


def stripe_exponent(currency: str) -> int:
    """The digits after the point of ``currency`` in Stripe's minor units."""
    if currency in _ZERO:
        return 0
    return 3 if currency in _THREE else 2


def _kind(table: Table) -> str:
    if "payout_id" in table.header and "automatic_payout_id" not in table.header:
        return "payouts"
    if "automatic_payout_id" in table.header:
        return "payout_reconciliation"
    return "balance_change_from_activity"


def _tags(table: Table, cells: Cells, owner: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for column in table.header:
        found = _META.fullmatch(column)
        if found is not None and found.group(1) == owner:
            value = cells.text(column)
            if value is not None:
                out[found.group(2)] = value
    return out


def _row(table: Table, cells: Cells) -> SettlementRow:
    category = cells.required("reporting_category")
    entry = _ENTRIES.get(category, Entry.OTHER)
    net_currency = cells.currency("currency")
    assert net_currency is not None  # required() below refuses an empty one first
    gross = cells.amount("gross", net_currency, stripe_exponent)
    net = cells.amount("net", net_currency, stripe_exponent)
    fee = cells.amount("fee", net_currency, stripe_exponent) if "fee" in table.header else None
    currency, amount = net_currency, abs(gross)
    shown = cells.currency("customer_facing_currency")
    if shown is not None and cells.text("customer_facing_amount") is not None:
        currency = shown
        amount = abs(cells.amount("customer_facing_amount", shown, stripe_exponent))
    time_column = next(c for c in TIMES if c in table.header)
    payment = cells.bounded(
        "payment_intent_id", cells.first("payment_intent_id", "charge_id"), MAX_REFERENCE
    )
    source = cells.bounded("source_id", cells.text("source_id"), MAX_REFERENCE)
    payout = cells.bounded(
        "automatic_payout_id", cells.first("payout_id", "automatic_payout_id"), MAX_ACCOUNT
    )
    if entry is Entry.PAYOUT:
        reference = cells.first("payout_id", "source_id")
        batch = reference or payout
    else:
        reference = (payment or source) if entry is Entry.CAPTURE else (source or payment)
        batch = payout
    return SettlementRow(
        line=cells.line,
        key=str(
            cells.bounded(
                "balance_transaction_id", cells.required("balance_transaction_id"), MAX_KEY
            )
        ),
        entry=entry,
        category=category,
        account=cells.bounded("connected_account", cells.text("connected_account"), MAX_ACCOUNT),
        batch=batch,
        created_at=cells.time(time_column, UTC),
        reference=reference,
        payment_reference=payment or (source if entry is Entry.CAPTURE else None),
        merchant_reference=None,
        tags=_tags(table, cells, "refund" if entry is Entry.REFUND else "payment"),
        amount=amount,
        currency=currency,
        net_currency=net_currency,
        net=net,
        fee=fee,
        raw=cells.present(),
    )


def parse_stripe(table: Table) -> ParsedReport:
    """``table`` as a Stripe itemized report; ``SettlementReportInvalid`` for anything else."""
    table.require(REQUIRED, "a Stripe itemized report")
    if not any(c in table.header for c in TIMES):
        raise SettlementReportInvalid(
            "not a Stripe itemized report: the header has no created_utc (nor created, "
            "effective_at_utc, effective_at)",
            file=table.name,
            row=1,
        )
    rows: list[SettlementRow] = []
    seen: dict[str, int] = {}
    for cells in table.cells():
        for column in ("currency",):
            cells.required(column)
        row = _row(table, cells)
        if row.key in seen:
            raise cells.refuse(
                "balance_transaction_id",
                f"{row.key!r} is also on row {seen[row.key]}: one balance transaction, two rows",
            )
        seen[row.key] = row.line
        rows.append(row)
    return ParsedReport(
        name=table.name,
        digest=table.digest,
        format=FORMAT,
        kind=_kind(table),
        account=table.one_account((r.account for r in rows), "connected_account"),
        rows=tuple(rows),
    )
