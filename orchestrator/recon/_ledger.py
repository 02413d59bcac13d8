"""The recon tables' statements: a file and its rows stored in one transaction, rows judged,
operations looked up in bulk by what a report names, and the sums a report shows."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..provider.settlement._rows import ParsedReport, SettlementRow
from ..records import OperationRecord
from ..storage._engine import read_in_transaction, run_in_transaction
from ..storage._store import Store
from ..storage._tables import db_now, operations, recon_files, recon_providers, recon_rows

__all__ = [
    "AlreadyJudged",
    "Stored",
    "by_column",
    "pending",
    "record_judged",
    "record_one_judged",
    "store_report",
]

_CHUNK = 500  # values per IN list: one statement per chunk, whatever the file's size
_ROW_CHUNK = 1000  # rows per INSERT


@dataclass(frozen=True)
class Stored:
    """What storing a file did: whether the file was new, and the keys of its new rows."""

    new_file: bool
    new_keys: frozenset[str]


def _chunks(values: Sequence[Any], size: int = _CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def _row_values(
    report: ParsedReport, row: SettlementRow, where: tuple[str, str], now: datetime
) -> dict[str, Any]:
    provider, account = where
    detail: dict[str, Any] = {"raw": dict(row.raw)}
    if row.tags:
        detail["tags"] = dict(row.tags)
    if row.payment_merchant_reference and row.payment_merchant_reference != row.merchant_reference:
        detail["payment_merchant_reference"] = row.payment_merchant_reference
    return {
        "provider": provider,
        "account": account,
        "row_key": row.key,
        "file_digest": report.digest,
        "line": row.line,
        "entry": row.entry.value,
        "category": row.category[:80],
        "batch": row.batch,
        "booked_at": row.created_at,
        "reference": row.reference,
        "payment_reference": row.payment_reference,
        "merchant_reference": row.merchant_reference,
        "amount": row.amount,
        "currency": row.currency,
        "net_currency": row.net_currency,
        "net": row.net,
        "fee": row.fee,
        "class": None,
        "tenant_id": None,
        "operation_id": None,
        "detail": detail,
        "imported_at": now,
        "judged_at": None,
    }


def store_report(store: Store, report: ParsedReport, provider: str, account: str) -> Stored:
    """Store ``report``'s file and its rows not stored before (by provider, account and row
    key), in one transaction: all of the file or nothing."""
    keys = [row.key for row in report.rows]
    times = [row.created_at for row in report.rows]
    r = recon_rows.c

    def txn(conn: Connection) -> Stored:
        known_file = conn.execute(
            sa.select(recon_files.c.digest).where(
                recon_files.c.provider == provider,
                recon_files.c.account == account,
                recon_files.c.digest == report.digest,
            )
        ).first()
        known: set[str] = set()
        for chunk in _chunks(keys):
            known.update(
                conn.execute(
                    sa.select(r.row_key).where(
                        r.provider == provider, r.account == account, r.row_key.in_(chunk)
                    )
                ).scalars()
            )
        new = [row for row in report.rows if row.key not in known]
        # One time for the file's rows (an executemany takes values, not SQL per row).
        now = conn.execute(sa.select(db_now())).scalar_one()
        for chunk in _chunks(new, _ROW_CHUNK):
            values = [_row_values(report, row, (provider, account), now) for row in chunk]
            conn.execute(recon_rows.insert(), values)
        if known_file is None:
            conn.execute(
                recon_files.insert().values(
                    provider=provider,
                    account=account,
                    digest=report.digest,
                    name=report.name[-255:],
                    format=report.format,
                    kind=report.kind,
                    rows=len(report.rows),
                    new_rows=len(new),
                    first_at=min(times) if times else None,
                    last_at=max(times) if times else None,
                    imported_at=db_now(),
                )
            )
        return Stored(new_file=known_file is None, new_keys=frozenset(row.key for row in new))

    return run_in_transaction(store.engine, txn)


def accounts_of(store: Store, provider: str, digest: str) -> set[str]:
    """The accounts a file (by digest) was imported for."""
    f = recon_files.c
    query = sa.select(f.account).where(f.provider == provider, f.digest == digest)
    return read_in_transaction(store.engine, lambda conn: set(conn.execute(query).scalars()))


def pending(store: Store, provider: str, account: str) -> list[Mapping[str, Any]]:
    """The account's rows not judged yet, in booking order (a file's, or a stopped one's)."""
    r = recon_rows.c
    query = (
        sa.select(recon_rows)
        .where(r.provider == provider, r.account == account, r["class"].is_(None))
        .order_by(r.booked_at, r.file_digest, r.line)
    )
    return read_in_transaction(
        store.engine, lambda conn: [dict(m) for m in conn.execute(query).mappings()]
    )


def judged(
    where: tuple[str, str, str],
    klass: str,
    record: OperationRecord | None,
    detail: Mapping[str, Any],
) -> dict[str, Any]:
    """The parameters of :data:`JUDGED` that record a row's class."""
    provider, account, key = where
    return {
        "w_provider": provider,
        "w_account": account,
        "w_key": key,
        "v_class": klass,
        "v_tenant": record.tenant_id if record is not None else None,
        "v_operation": record.id if record is not None else None,
        "v_detail": dict(detail),
    }


_r = recon_rows.c
# One statement for every judged row: run once in the transaction that acts on the row's
# operation, or for many rows at once (an executemany) when nothing else is written.
JUDGED = (
    recon_rows.update()
    .where(
        _r.provider == sa.bindparam("w_provider"),
        _r.account == sa.bindparam("w_account"),
        _r.row_key == sa.bindparam("w_key"),
        # Judged once: another import judging the same rows at once changes none twice.
        _r["class"].is_(None),
    )
    .values(
        {
            "class": sa.bindparam("v_class"),
            "tenant_id": sa.bindparam("v_tenant"),
            "operation_id": sa.bindparam("v_operation"),
            "detail": sa.bindparam("v_detail", type_=recon_rows.c.detail.type),
            "judged_at": db_now(),
        }
    )
)


class AlreadyJudged(Exception):
    """Another import judged the row first: the transaction acting on it is rolled back."""


def record_judged(conn: Connection, params: Sequence[Mapping[str, Any]]) -> None:
    """Record rows as judged (rows another import judged meanwhile are left as they are)."""
    if params:
        conn.execute(JUDGED, list(params))


def record_one_judged(conn: Connection, params: Mapping[str, Any]) -> None:
    """Record one row as judged, in the transaction that acts on its operation: raises
    :class:`AlreadyJudged` (rolling that back) when another import judged it first."""
    if conn.execute(JUDGED, dict(params)).rowcount != 1:
        raise AlreadyJudged(params["w_key"])


def run(store: Store, statement: sa.Executable) -> None:
    run_in_transaction(store.engine, lambda conn: conn.execute(statement))


def _operations(
    store: Store, provider: str, column: sa.Column[Any], values: Collection[str]
) -> list[OperationRecord]:
    t = operations.c
    found: list[OperationRecord] = []
    distinct = sorted(set(values))

    def read(conn: Connection) -> None:
        for chunk in _chunks(distinct):
            rows = conn.execute(
                sa.select(operations).where(t.provider == provider, column.in_(chunk))
            ).mappings()
            found.extend(OperationRecord.from_row(row) for row in rows)

    if distinct:
        read_in_transaction(store.engine, read)
    return found


def by_column(
    store: Store, provider: str, column: sa.Column[Any], values: Iterable[str | None]
) -> dict[str, list[OperationRecord]]:
    """The operations (of any tenant) of ``provider`` holding each of ``values`` in
    ``column`` (``provider_reference``, ``downstream_key``)."""
    out: dict[str, list[OperationRecord]] = {}
    wanted = [v for v in values if v]
    for record in _operations(store, provider, column, wanted):
        out.setdefault(str(getattr(record, column.name)), []).append(record)
    return out


def seen_references(store: Store, provider: str, references: Collection[str]) -> set[str]:
    """Which of ``references`` a stored row of ``provider`` names (as its own or its
    payment's)."""
    r = recon_rows.c
    seen: set[str] = set()
    refs = sorted(set(references))

    def read(conn: Connection) -> None:
        for chunk in _chunks(refs):
            for column in (r.reference, r.payment_reference):
                seen.update(
                    conn.execute(
                        sa.select(column).where(r.provider == provider, column.in_(chunk))
                    ).scalars()
                )

    if refs:
        read_in_transaction(store.engine, read)
    return seen


def first_booked(store: Store, provider: str) -> datetime | None:
    r = recon_rows.c
    return read_in_transaction(
        store.engine,
        lambda conn: conn.execute(
            sa.select(sa.func.min(r.booked_at)).where(r.provider == provider)
        ).scalar(),
    )


def save_expected(store: Store, values: Mapping[str, Any]) -> None:
    """Replace the provider's row of ``payorch_recon_providers``, its rows per class counted
    in the same transaction (by the class index: the provider's rows, not every row)."""
    p, r = recon_providers.c, recon_rows.c
    tally = (
        sa.select(r["class"], sa.func.count())
        .where(r.provider == values["provider"], r["class"].is_not(None))
        .group_by(r["class"])
    )

    def txn(conn: Connection) -> None:
        counts = {str(k): int(n) for k, n in conn.execute(tally).all()}
        conn.execute(recon_providers.delete().where(p.provider == values["provider"]))
        conn.execute(recon_providers.insert().values(**values, counts=counts, checked_at=db_now()))

    run_in_transaction(store.engine, txn)


def batch_sums(
    store: Store, provider: str, account: str, batches: Collection[str] | None = None
) -> list[Mapping[str, Any]]:
    """Per batch and settlement currency: rows, the net of the rows that are not the payout,
    the payout rows' net and count (``batches``: only these; None: every batch)."""
    r = recon_rows.c
    is_payout = r.entry == "payout"
    query = (
        sa.select(
            r.batch,
            r.net_currency,
            sa.func.count().label("rows"),
            sa.func.coalesce(sa.func.sum(sa.case((is_payout, 0), else_=r.net)), 0).label("net"),
            sa.func.coalesce(sa.func.sum(sa.case((is_payout, r.net), else_=0)), 0).label("payout"),
            sa.func.count(sa.case((is_payout, 1))).label("payouts"),
        )
        .where(r.provider == provider, r.account == account, r.batch.is_not(None))
        .group_by(r.batch, r.net_currency)
        .order_by(r.batch, r.net_currency)
    )
    wanted = sorted(set(batches)) if batches is not None else None
    if wanted is not None and not wanted:
        return []

    def read(conn: Connection) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = []
        for chunk in _chunks(wanted) if wanted is not None else [None]:
            q = query if chunk is None else query.where(r.batch.in_(chunk))
            out.extend(dict(m) for m in conn.execute(q).mappings())
        return out

    return read_in_transaction(store.engine, read)
