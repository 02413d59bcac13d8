"""The report formats payorch reads, by name, and :func:`parse_report`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ...errors import InvalidRequest
from ._adyen import parse_adyen
from ._rows import ParsedReport
from ._stripe import parse_stripe
from ._table import Table, read_table

__all__ = ["FORMATS", "parse_report"]

FORMATS: Mapping[str, Callable[[Table], ParsedReport]] = {
    "stripe": parse_stripe,
    "adyen": parse_adyen,
}


def parse_report(data: bytes, name: str, format: str) -> ParsedReport:
    """``data``, a whole report file named ``name``, read in ``format`` (``stripe`` or
    ``adyen``); ``SettlementReportInvalid`` naming the row and column it cannot read."""
    parse = FORMATS.get(format)
    if parse is None:
        raise InvalidRequest(f"unknown report format {format!r}: one of {', '.join(FORMATS)}")
    return parse(read_table(data, name))
