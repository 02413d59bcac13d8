"""``payorch recon report``: per file and batch, what the settlement rows are; the flagged
ones, the orphans and the expected operations (plain values, JSON-able)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..storage._engine import read_in_transaction
from ..storage._store import Store
from ..storage._tables import recon_files, recon_rows
from . import _ledger as ledger
from ._expected import ExpectedCheck, check_expected
from ._judge import ReconPolicy, RowClass
from ._orphans import refusal_of

__all__ = ["BatchCheck", "FileSummary", "ListedRow", "ReconReport", "build_report", "check_batches"]

MAX_LISTED = 1000  # flagged rows and orphans listed per report (the counts are whole)
_LISTED = [RowClass.DUPLICATE, RowClass.CONTRADICTION, RowClass.MISMATCH, RowClass.ORPHAN]


@dataclass(frozen=True, kw_only=True)
class BatchCheck:
    """A batch's rows against its total, in one settlement currency.

    ``net``: the sum of the net of its rows that are not the payout; ``paid``: what the
    payout row(s) paid to the bank (None while no payout row was imported)."""

    provider: str
    account: str
    batch: str
    currency: str
    rows: int
    net: int
    paid: int | None
    payouts: int = 0  # payout rows among ``rows``

    @property
    def status(self) -> str:
        if self.paid is None or self.rows <= self.payouts:
            return "open"  # no payout row yet, or none of the rows it pays out
        return "balanced" if self.net == self.paid else "unbalanced"

    @property
    def difference(self) -> int | None:
        return None if self.status == "open" or self.paid is None else self.net - self.paid

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "account": self.account,
            "batch": self.batch,
            "currency": self.currency,
            "rows": self.rows,
            "net": self.net,
            "paid": self.paid,
            "status": self.status,
            "difference": self.difference,
        }


def check_batches(
    store: Store, provider: str, account: str, batches: Sequence[str] | None = None
) -> list[BatchCheck]:
    """Each batch's net sum against its payout (``batches``: only these)."""
    return [
        BatchCheck(
            provider=provider,
            account=account,
            batch=row["batch"],
            currency=row["net_currency"],
            rows=int(row["rows"]),
            net=int(row["net"]),
            # The payout leaves the balance (negative): what reached the bank is its opposite.
            paid=-int(row["payout"]) if row["payouts"] else None,
            payouts=int(row["payouts"]),
        )
        for row in ledger.batch_sums(store, provider, account, batches)
    ]


@dataclass(frozen=True, kw_only=True)
class FileSummary:
    provider: str
    account: str
    digest: str
    name: str
    format: str
    kind: str
    rows: int
    new_rows: int
    imported_at: datetime
    counts: Mapping[str, int]  # per class of the rows it brought (None: not judged yet)

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "account": self.account,
            "digest": self.digest,
            "name": self.name,
            "format": self.format,
            "kind": self.kind,
            "rows": self.rows,
            "new_rows": self.new_rows,
            "imported_at": self.imported_at.isoformat(),
            "counts": dict(self.counts),
        }


@dataclass(frozen=True, kw_only=True)
class ListedRow:
    """A flagged row or an orphan, with what an operator needs to act on it."""

    provider: str
    account: str
    row_key: str
    klass: str
    file: str
    line: int
    batch: str | None
    category: str
    reference: str | None
    payment_reference: str | None
    amount: int | None
    currency: str | None
    booked_at: datetime
    tenant_id: str | None
    operation_id: str | None
    detail: Mapping[str, Any]
    refusal: str | None = None  # an orphan's: why it cannot be adopted

    def to_dict(self) -> dict[str, Any]:
        detail = {k: v for k, v in self.detail.items() if k not in ("raw",)}
        return {
            "provider": self.provider,
            "account": self.account,
            "row": self.row_key,
            "class": self.klass,
            "file": self.file,
            "line": self.line,
            "batch": self.batch,
            "category": self.category,
            "reference": self.reference,
            "payment_reference": self.payment_reference,
            "amount": self.amount,
            "currency": self.currency,
            "booked_at": self.booked_at.isoformat(),
            "tenant_id": self.tenant_id,
            "operation_id": self.operation_id,
            "detail": detail,
            "adoptable": self.klass == RowClass.ORPHAN
            and self.refusal is None
            and not detail.get("adopted_as"),
            "refusal": self.refusal,
        }


@dataclass(frozen=True, kw_only=True)
class ReconReport:
    files: tuple[FileSummary, ...]
    batches: tuple[BatchCheck, ...]
    listed: tuple[ListedRow, ...]
    expected: tuple[ExpectedCheck, ...]
    counts: Mapping[str, int] = field(default_factory=dict)  # per class, every file in scope
    truncated: bool = False  # more flagged rows or orphans than listed

    @property
    def duplicates(self) -> int:
        return self.counts.get(RowClass.DUPLICATE, 0)

    @property
    def unbalanced(self) -> list[BatchCheck]:
        return [b for b in self.batches if b.status == "unbalanced"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "files": [f.to_dict() for f in self.files],
            "batches": [b.to_dict() for b in self.batches],
            "listed": [r.to_dict() for r in self.listed],
            "truncated": self.truncated,
            "expected": [
                {
                    "provider": check.provider,
                    "since": check.since.isoformat() if check.since else None,
                    "expected": len(check.items),
                    "overdue": check.overdue,
                    "truncated": check.truncated,
                    "operations": [
                        {
                            "tenant_id": item.operation.tenant_id,
                            "operation_id": item.operation.id,
                            "operation": item.operation.operation,
                            "provider_reference": item.operation.provider_reference,
                            "amount": item.operation.amount,
                            "currency": item.operation.currency,
                            "completed_at": item.operation.completed_at.isoformat()
                            if item.operation.completed_at
                            else None,
                            "overdue": item.overdue,
                        }
                        for item in check.items
                    ],
                }
                for check in self.expected
            ],
        }


def build_report(
    store: Store,
    *,
    provider: str | None = None,
    account: str | None = None,
    digest: str | None = None,
    policy: ReconPolicy | None = None,
) -> ReconReport:
    """The files in scope (a provider, an account, one file by digest prefix), their
    batches checked, the rows to act on, and each provider's expected operations (counted
    now, and kept for the metrics)."""
    policy = policy or ReconPolicy()
    f, r = recon_files.c, recon_rows.c
    scope: list[sa.ColumnElement[bool]] = []
    if provider is not None:
        scope.append(f.provider == provider)
    if account is not None:
        scope.append(f.account == account)
    if digest is not None:
        scope.append(f.digest.startswith(digest, autoescape=True))

    Rows = list[dict[str, Any]]

    def read(conn: Connection) -> tuple[Rows, Rows, Rows, Rows]:
        files = [
            dict(m)
            for m in conn.execute(
                sa.select(recon_files).where(*scope).order_by(f.imported_at, f.name)
            ).mappings()
        ]
        digests = [x["digest"] for x in files]
        counts = (
            [
                dict(m)
                for m in conn.execute(
                    sa.select(r.file_digest, r["class"], sa.func.count().label("n"))
                    .where(r.file_digest.in_(digests))
                    .group_by(r.file_digest, r["class"])
                ).mappings()
            ]
            if digests
            else []
        )
        listed = (
            [
                dict(m)
                for m in conn.execute(
                    sa.select(recon_rows)
                    .where(r.file_digest.in_(digests), r["class"].in_([c.value for c in _LISTED]))
                    .order_by(r.booked_at, r.line)
                    .limit(MAX_LISTED + 1)
                ).mappings()
            ]
            if digests
            else []
        )
        touched = (
            [
                dict(m)
                for m in conn.execute(
                    sa.select(r.provider, r.account, r.batch)
                    .distinct()
                    .where(r.file_digest.in_(digests), r.batch.is_not(None))
                ).mappings()
            ]
            if digests and digest is not None
            else []
        )
        return files, counts, listed, touched

    files, counts, listed, touched = read_in_transaction(store.engine, read)
    per_file: dict[str, dict[str, int]] = {}
    total: dict[str, int] = {}
    for c in counts:
        name = c["class"] or "pending"
        per_file.setdefault(c["file_digest"], {})[name] = int(c["n"])
        total[name] = total.get(name, 0) + int(c["n"])
    names = {x["digest"]: x["name"] for x in files}
    summaries = tuple(
        FileSummary(
            provider=x["provider"],
            account=x["account"],
            digest=x["digest"],
            name=x["name"],
            format=x["format"],
            kind=x["kind"],
            rows=x["rows"],
            new_rows=x["new_rows"],
            imported_at=x["imported_at"],
            counts=per_file.get(x["digest"], {}),
        )
        for x in files
    )
    accounts = sorted({(x["provider"], x["account"]) for x in files})
    wanted: dict[tuple[str, str], list[str]] | None = None
    if digest is not None:  # one file: the batches its rows are in
        wanted = {}
        for t in touched:
            wanted.setdefault((t["provider"], t["account"]), []).append(t["batch"])
    batches = tuple(
        b
        for p, a in accounts
        if wanted is None or (p, a) in wanted
        for b in check_batches(store, p, a, None if wanted is None else wanted[(p, a)])
    )
    rows = tuple(
        ListedRow(
            provider=m["provider"],
            account=m["account"],
            row_key=m["row_key"],
            klass=m["class"],
            file=str(names.get(m["file_digest"], m["file_digest"])),
            line=m["line"],
            batch=m["batch"],
            category=m["category"],
            reference=m["reference"],
            payment_reference=m["payment_reference"],
            amount=m["amount"],
            currency=m["currency"],
            booked_at=m["booked_at"],
            tenant_id=m["tenant_id"],
            operation_id=m["operation_id"],
            detail=m["detail"] or {},
            refusal=refusal_of(m) if m["class"] == RowClass.ORPHAN else None,
        )
        for m in listed[:MAX_LISTED]
    )
    providers = sorted({p for p, _ in accounts})
    expected = tuple(check_expected(store, p, policy) for p in providers)
    return ReconReport(
        files=summaries,
        batches=batches,
        listed=rows,
        expected=expected,
        counts=total,
        truncated=len(listed) > MAX_LISTED,
    )
