"""Settlement reports as evidence: ``payorch.recon``.

A provider's settlement report is the file of what it actually captured, refunded, charged
back and paid out, batch by batch: the one evidence that covers every effect, including
those no webhook reported and no listing reaches. :func:`import_report` reads Stripe's
itemized reports and Adyen's Settlement details report (:mod:`payorch.provider.settlement`),
stores their rows once (a second import changes nothing), and judges each row against the
operations (:class:`RowClass`): it settles unknown operations as a status query would (audited as
``resolution=settlement``), flags contradictions, amount mismatches and second effects for
one namespace, lists orphans (:func:`adopt_orphan` adopts one) and, per provider, the
operations still expected. :func:`build_report` is ``payorch recon report``.
See docs/reconciliation.md.
"""

from ._expected import Expected, ExpectedCheck, check_expected
from ._importer import ImportResult, import_report, report_format
from ._judge import RESOLUTION, ReconPolicy, RowClass, Verdict
from ._orphans import adopt_orphan
from ._report import BatchCheck, FileSummary, ListedRow, ReconReport, build_report, check_batches

__all__ = [
    "RESOLUTION",
    "BatchCheck",
    "Expected",
    "ExpectedCheck",
    "FileSummary",
    "ImportResult",
    "ListedRow",
    "ReconPolicy",
    "ReconReport",
    "RowClass",
    "Verdict",
    "adopt_orphan",
    "build_report",
    "check_batches",
    "check_expected",
    "import_report",
    "report_format",
]
