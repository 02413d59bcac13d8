"""Settlement reports as evidence: ``payorch.recon``.

A provider's settlement report is the file of what it actually captured, refunded, charged
back and paid out, batch by batch: the one evidence that covers every effect, including
those no webhook reported and no listing reaches. :func:`import_report` reads Stripe's
itemized reports and Adyen's Settlement details report, stores their rows once (a second
import changes nothing), and judges each row against the operations
(:class:`RowClass`): it settles unknown operations as a status query would (audited as
``resolution=settlement``), flags contradictions, amount mismatches and second effects for
one namespace, lists orphans (:func:`adopt_orphan` adopts one) and, per provider, the
operations still expected. :func:`build_report` is ``payorch recon report``.
See docs/reconciliation.md.
"""

from ._expected import Expected, ExpectedCheck, check_expected
from ._importer import FORMATS, ImportResult, import_report, parse_report, report_format
from ._judge import RESOLUTION, ReconPolicy, RowClass, Verdict
from ._orphans import adopt_orphan
from ._report import BatchCheck, FileSummary, ListedRow, ReconReport, build_report, check_batches
from ._rows import Entry, ParsedReport, SettlementRow
from ._writers import ReportEntry, write_adyen_settlement, write_stripe_itemized

__all__ = [
    "FORMATS",
    "RESOLUTION",
    "BatchCheck",
    "Entry",
    "Expected",
    "ExpectedCheck",
    "FileSummary",
    "ImportResult",
    "ListedRow",
    "ParsedReport",
    "ReconPolicy",
    "ReconReport",
    "ReportEntry",
    "RowClass",
    "SettlementRow",
    "Verdict",
    "adopt_orphan",
    "build_report",
    "check_batches",
    "check_expected",
    "import_report",
    "parse_report",
    "report_format",
    "write_adyen_settlement",
    "write_stripe_itemized",
]
