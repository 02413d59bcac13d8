"""Importing a settlement report: parse the whole file, store it and its new rows in one
transaction, judge every row not judged yet, check the batches it touches, count what is
still expected.

A second import of the same file, or a file overlapping one imported (rows by key), adds
nothing and changes nothing: its rows are known. An import that stopped after storing
(a crash, the database away) is finished by the next import of the provider's account:
rows are judged until none is left unjudged.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequest, SettlementAccountMismatch, SettlementReportInvalid
from ..provider.settlement._formats import FORMATS
from ..provider.settlement._rows import ParsedReport
from ..provider.settlement._table import read_table
from ..storage._store import Store
from . import _ledger as ledger
from ._expected import ExpectedCheck, check_expected
from ._judge import ReconPolicy, Verdict, judge_pending
from ._report import BatchCheck, check_batches

__all__ = ["ImportResult", "import_report", "report_format"]

# The providers whose reports are in a format of another name: the sandbox writes Stripe's.
_FORMAT_OF = {"stripe": "stripe", "adyen": "adyen", "sandbox": "stripe"}
DEFAULT_ACTOR = "payorch-recon"


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    """What one import did."""

    provider: str
    account: str
    report: ParsedReport
    new_file: bool
    new_rows: int
    verdicts: tuple[Verdict, ...]  # rows judged by this import (its own, or left over)
    batches: tuple[BatchCheck, ...]  # the batches the file's rows are in, checked
    expected: ExpectedCheck

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(v.klass.value for v in self.verdicts))

    @property
    def known_rows(self) -> int:
        return len(self.report.rows) - self.new_rows


def report_format(provider: str, format: str | None = None) -> str:
    """The report format to read ``provider``'s files in: ``format`` if given, else the one
    the provider's name implies; ``InvalidRequest`` naming the choices otherwise."""
    chosen = format or _FORMAT_OF.get(provider)
    if chosen is None:
        raise InvalidRequest(
            f"which report format are {provider!r}'s files in? name it: "
            f"{' or '.join(sorted(FORMATS))}"
        )
    if chosen not in FORMATS:
        raise InvalidRequest(
            f"unknown report format {chosen!r}: one of {', '.join(sorted(FORMATS))}"
        )
    return chosen


def _read(source: str | os.PathLike[str] | bytes, name: str | None) -> tuple[bytes, str]:
    if isinstance(source, bytes):
        return source, name or "report.csv"
    path = Path(source)
    shown = name or path.name
    try:
        return path.read_bytes(), shown
    except OSError as exc:
        raise SettlementReportInvalid(f"cannot be read ({exc.strerror})", file=str(path)) from None


def import_report(
    store: Store,
    source: str | os.PathLike[str] | bytes,
    *,
    provider: str,
    format: str | None = None,
    account: str | None = None,
    name: str | None = None,
    policy: ReconPolicy | None = None,
    actor: str = DEFAULT_ACTOR,
) -> ImportResult:
    """Import one settlement report of ``provider`` (a path, or the file's bytes).

    ``account``: the merchant account it must be for; a file whose rows name another is
    refused (``SettlementAccountMismatch``), and one that names none is recorded under it.
    A file that cannot be read is refused whole (``SettlementReportInvalid``, naming the
    file, row and column). ``StorageError`` when the database is away: nothing, or the
    whole file, was stored; import it again.
    """
    policy = policy or ReconPolicy()
    chosen = report_format(provider, format)
    data, shown = _read(source, name)
    report = FORMATS[chosen](read_table(data, shown))
    if account is not None and report.account is not None and report.account != account:
        raise SettlementAccountMismatch(
            f"{shown}: its rows are for merchant account {report.account!r}, not "
            f"{account!r}; nothing imported"
        )
    into = account if account is not None else (report.account or "")
    elsewhere = ledger.accounts_of(store, provider, report.digest) - {into}
    if elsewhere:
        # Rows naming no account are keyed by the one given: the same file under another
        # would be imported, and judged, twice.
        raise SettlementAccountMismatch(
            f"{shown}: imported before for account {sorted(elsewhere)[0]!r}, not {into!r}; "
            "nothing imported"
        )
    stored = ledger.store_report(store, report, provider, into)
    verdicts = tuple(judge_pending(store, provider, into, policy, actor))
    touched = sorted({row.batch for row in report.rows if row.batch is not None})
    return ImportResult(
        provider=provider,
        account=into,
        report=report,
        new_file=stored.new_file,
        new_rows=len(stored.new_keys),
        verdicts=verdicts,
        batches=tuple(check_batches(store, provider, into, touched)),
        expected=check_expected(store, provider, policy, flag=True, actor=actor),
    )
