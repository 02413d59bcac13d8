"""Settlement report formats: ``payorch.provider.settlement``, pure (bytes in, values out).

:func:`parse_report` reads Stripe's itemized balance and payout reconciliation reports and
Adyen's Settlement details report as the providers document them (columns by name; a file
that cannot be read is refused whole, naming its row and column); :func:`write_stripe_itemized`
and :func:`write_adyen_settlement` write them, for emulators, tests and demos.
:mod:`payorch.recon` imports and judges what they read. See docs/reconciliation.md.
"""

from ._adyen import adyen_exponent
from ._formats import FORMATS, parse_report
from ._rows import Entry, ParsedReport, SettlementRow
from ._stripe import stripe_exponent
from ._writers import ReportEntry, write_adyen_settlement, write_stripe_itemized

__all__ = [
    "FORMATS",
    "Entry",
    "ParsedReport",
    "ReportEntry",
    "SettlementRow",
    "adyen_exponent",
    "parse_report",
    "stripe_exponent",
    "write_adyen_settlement",
    "write_stripe_itemized",
]
