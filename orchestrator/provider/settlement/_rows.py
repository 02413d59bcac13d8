"""What a settlement report says, one row at a time, whatever the provider's format: plain
values, no I/O (:mod:`payorch.recon`'s parsers make them, its importer stores and judges them).

Amounts are integer minor units of their currency, as payorch stores an operation's amount;
signed from the merchant's balance: a credit (a captured payment) is positive, a debit (a
refund, a chargeback, fees, the payout to the bank) negative. So a batch is balanced when the
net of all its rows, its payout row included, is zero.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

__all__ = ["Entry", "ParsedReport", "SettlementRow"]


class Entry(enum.StrEnum):
    """What a row moved, in payorch's words (each format maps its own categories onto it)."""

    CAPTURE = "capture"  # a payment's funds captured (Stripe ``charge``, Adyen ``Settled``)
    REFUND = "refund"  # Stripe ``refund``, Adyen ``Refunded``
    REFUND_REVERSAL = "refund_reversal"  # a refund that failed and came back
    CHARGEBACK = "chargeback"  # a dispute lost (or opened) at the scheme
    CHARGEBACK_REVERSAL = "chargeback_reversal"
    PAYOUT = "payout"  # the batch's transfer to the bank: its total
    OTHER = "other"  # fees, adjustments, corrections: counted in the batch, no operation's

    @property
    def effect(self) -> bool:
        """Whether payorch makes such effects (a row of it is matched to an operation)."""
        return self in (Entry.CAPTURE, Entry.REFUND)


@dataclass(frozen=True, kw_only=True)
class SettlementRow:
    """One row of a settlement report, parsed."""

    line: int  # the file's line number (the header is line 1)
    key: str  # unique per provider and account: what makes a second import a no-op
    entry: Entry
    category: str  # the provider's own word for it (``charge``, ``Settled`` …)
    account: str | None  # the merchant account the row names, when the format has one
    batch: str | None  # the payout / settlement batch it belongs to (None: not yet paid out)
    created_at: datetime  # when the provider booked it (aware, UTC)
    # The effect's own id (``pi_…``/``re_…``, a payment's or refund's PSP reference) and the
    # payment it belongs to (the same for a capture).
    reference: str | None
    payment_reference: str | None
    merchant_reference: str | None  # the reference payorch sent (Adyen: the downstream key)
    # The payment's, on a refund's or a separate capture's row (Adyen's Merchant Reference).
    payment_merchant_reference: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)  # payorch_* metadata, when reported
    # What the customer was charged: the amount an operation holds, in its currency.
    amount: int | None
    currency: str | None
    # The balance's side: settlement currency, signed (see the module's docstring).
    net_currency: str
    net: int
    fee: int | None = None
    raw: Mapping[str, str] = field(default_factory=dict)  # the row's non-empty cells


@dataclass(frozen=True, kw_only=True)
class ParsedReport:
    """A whole file, parsed: nothing of it is stored until every row parsed."""

    name: str
    digest: str  # SHA-256 of the file's bytes
    format: str  # "stripe" or "adyen"
    kind: str  # which of the format's reports it is (e.g. "payout_reconciliation")
    account: str | None  # the merchant account its rows name (None: the format names none)
    rows: tuple[SettlementRow, ...]
