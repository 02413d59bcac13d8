"""A report file as a table of named cells: the CSV reading both formats share, and the
cell readers (amounts, currencies, times) that name the file, row and column they refuse.

Columns are found by their header, never by position: providers add columns by account and
by version, and let users choose and order them. A file is read whole before anything is
stored; the first cell that cannot be read refuses the whole file
(:class:`~payorch.errors.SettlementReportInvalid`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation

from iso4217 import Currency

from ...errors import SettlementReportInvalid

__all__ = ["Cells", "Table", "read_table"]

MAX_FILE_BYTES = 512 * 1024 * 1024  # a day of a large merchant fits; a wrong file does not
MAX_MINOR = 10**15  # minor units: as an operation's amount is bounded (and a BIGINT holds it)
MAX_KEY, MAX_ACCOUNT, MAX_REFERENCE = 128, 80, 255  # what the recon tables hold
_AMOUNT = re.compile(r"[+-]?(\d+([.,]\d*)?|[.,]\d+)")
_TIME_FORMATS = ("%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d")


@dataclass(frozen=True)
class Table:
    """A CSV file's header and rows (each with its line number), and its bytes' digest."""

    name: str
    digest: str
    header: tuple[str, ...]
    rows: tuple[tuple[int, tuple[str, ...]], ...]

    def require(self, columns: Sequence[str], what: str) -> None:
        """Refuse a file that lacks one of ``columns`` (another format, or a cut header)."""
        missing = [c for c in columns if c not in self.header]
        if missing:
            raise SettlementReportInvalid(
                f"not {what}: the header lacks {', '.join(repr(c) for c in missing)}",
                file=self.name,
                row=1,
            )

    def one_account(self, accounts: Iterable[str | None], column: str) -> str | None:
        """The one account the rows name (None: they name none); several refuse the file."""
        named = {a for a in accounts if a is not None}
        if len(named) > 1:
            raise SettlementReportInvalid(
                f"rows of several accounts ({', '.join(sorted(named))}): import one account's "
                "report at a time",
                file=self.name,
                column=column,
            )
        return next(iter(named), None)

    def cells(self) -> Iterator[Cells]:
        for line, values in self.rows:
            yield Cells(self.name, line, dict(zip(self.header, values, strict=True)))


def read_table(data: bytes, name: str) -> Table:
    """``data`` (a whole file) as a :class:`Table`; refuses what is not a complete CSV."""
    if len(data) > MAX_FILE_BYTES:
        raise SettlementReportInvalid(f"larger than {MAX_FILE_BYTES} bytes", file=name)
    try:
        text = data.decode("utf-8-sig")  # Excel and some exports lead with a BOM
    except UnicodeDecodeError as exc:
        raise SettlementReportInvalid(f"not UTF-8 text ({exc.reason})", file=name) from None
    if not text.strip():
        raise SettlementReportInvalid("empty: no header, no rows", file=name)
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    rows: list[tuple[int, tuple[str, ...]]] = []
    header: tuple[str, ...] | None = None
    try:
        for values in reader:
            line = reader.line_num
            if not values or all(not v.strip() for v in values):
                continue  # a blank line, as spreadsheets leave at the end
            cells = tuple(v.strip() for v in values)
            if header is None:
                header = cells
                twice = sorted({c for c in header if header.count(c) > 1 and c})
                if twice:
                    raise SettlementReportInvalid(
                        f"the header names {twice[0]!r} twice", file=name, row=line
                    )
                continue
            if len(cells) != len(header):
                raise SettlementReportInvalid(
                    f"{len(cells)} cells where the header has {len(header)} "
                    "(a truncated or hand-edited file?)",
                    file=name,
                    row=line,
                )
            rows.append((line, cells))
    except csv.Error as exc:
        raise SettlementReportInvalid(
            f"not a readable CSV ({exc}; a truncated file?)", file=name, row=reader.line_num
        ) from None
    assert header is not None
    digest = hashlib.sha256(data).hexdigest()
    return Table(name=name, digest=digest, header=header, rows=tuple(rows))


class Cells:
    """One row's cells by column name, with readers that refuse in one line."""

    def __init__(self, file: str, line: int, values: Mapping[str, str]) -> None:
        self.file = file
        self.line = line
        self.values = values

    def refuse(self, column: str | None, message: str) -> SettlementReportInvalid:
        return SettlementReportInvalid(message, file=self.file, row=self.line, column=column)

    def text(self, column: str) -> str | None:
        """The cell, or None when the column is absent or the cell empty (``""`` too)."""
        value = self.values.get(column)
        return value if value else None

    def first(self, *columns: str) -> str | None:
        for column in columns:
            value = self.text(column)
            if value is not None:
                return value
        return None

    def required(self, column: str) -> str:
        value = self.text(column)
        if value is None:
            raise self.refuse(column, "empty, and every row needs it")
        return value

    def currency(self, column: str) -> str | None:
        value = self.text(column)
        if value is None:
            return None
        code = value.upper()
        try:
            Currency(code)
        except ValueError:
            raise self.refuse(column, f"{value!r} is not an ISO 4217 currency") from None
        return code

    def amount(self, column: str, currency: str | None, exponent: Callable[[str], int]) -> int:
        """The cell, a decimal in major units, as integer minor units of ``currency``
        (0 when empty). Refuses what is not a number, or has more decimals than the currency."""
        value = self.text(column)
        if value is None:
            return 0
        if not _AMOUNT.fullmatch(value):
            raise self.refuse(column, f"{value!r} is not an amount")
        if currency is None:
            raise self.refuse(column, f"{value!r} has no currency in its row")
        try:
            number = Decimal(value.replace(",", "."))
        except InvalidOperation:
            raise self.refuse(column, f"{value!r} is not an amount") from None
        minor = number.scaleb(exponent(currency))
        if minor != minor.to_integral_value():
            raise self.refuse(
                column, f"{value!r} has more decimals than {currency} has minor units"
            )
        if abs(minor) > MAX_MINOR:
            raise self.refuse(column, f"{value!r} is larger than any payment")
        return int(minor)

    def bounded(self, column: str, value: str | None, limit: int) -> str | None:
        """``value`` (read from ``column``), refused when longer than payorch stores."""
        if value is not None and len(value) > limit:
            raise self.refuse(column, f"longer than {limit} characters")
        return value

    def time(self, column: str, zone: timezone = UTC) -> datetime:
        """The cell as an aware UTC time; a time without an offset is in ``zone``."""
        value = self.required(column)
        parsed: datetime | None = None
        for fmt in _TIME_FORMATS:
            try:
                parsed = datetime.strptime(value, fmt)
                break
            except ValueError:
                continue
        if parsed is None:
            try:
                parsed = datetime.fromisoformat(value)
            except ValueError:
                raise self.refuse(column, f"{value!r} is not a date and time") from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=zone)
        try:
            return parsed.astimezone(UTC)
        except OverflowError:
            raise self.refuse(column, f"{value!r} is out of range") from None

    def present(self) -> dict[str, str]:
        """The row's non-empty cells (kept as the row's evidence)."""
        return {k: v for k, v in self.values.items() if v and k}


def fixed_zone(hours: float) -> timezone:
    return timezone(timedelta(hours=hours))
