"""Expected: operations that succeeded and no settlement report has shown yet.

A provider settles a day or more after the payment (its settlement lag): until then an
operation's absence from every report is expected and only listed; past the lag it is
*overdue* and flagged (the money may never arrive: an authorisation never captured, a
capture the provider lost, an effect booked under another account). Only operations that
succeeded since the first row a report showed for the provider are expected, so history
from before reconciling began is not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import StaleVersion
from ..observing import _metrics as metrics
from ..records import OperationRecord
from ..storage._engine import read_in_transaction
from ..storage._store import Store
from ..storage._tables import operations
from . import _ledger as ledger
from ._judge import ReconPolicy

__all__ = ["Expected", "check_expected"]

OVERDUE = "settlement_overdue"  # the event an overdue operation is flagged with, once
MAX_EXPECTED = 100_000  # operations read per check: a bound, reported when reached


@dataclass(frozen=True)
class Expected:
    """One succeeded operation no report has shown; ``overdue`` once past the lag."""

    operation: OperationRecord
    overdue: bool


@dataclass(frozen=True)
class ExpectedCheck:
    provider: str
    since: datetime | None
    now: datetime
    items: tuple[Expected, ...]
    truncated: bool

    @property
    def overdue(self) -> int:
        return sum(1 for item in self.items if item.overdue)


def check_expected(
    store: Store, provider: str, policy: ReconPolicy, *, flag: bool = False, actor: str = ""
) -> ExpectedCheck:
    """Count the provider's expected operations now, and keep the count for the metrics;
    with ``flag`` (an import does), flag each overdue one for attention, once."""
    now = store.db_time()
    since = ledger.first_booked(store, provider)
    if since is None:
        return ExpectedCheck(provider, None, now, (), False)
    t = operations.c
    query = (
        sa.select(operations)
        .where(
            t.provider == provider,
            t.state == "succeeded",
            t.operation.in_(sorted(set(policy.expected))),
            t.completed_at >= since,
        )
        .order_by(t.completed_at)
        .limit(MAX_EXPECTED + 1)
    )

    def read(conn: Connection) -> list[OperationRecord]:
        return [OperationRecord.from_row(m) for m in conn.execute(query).mappings()]

    succeeded = read_in_transaction(store.engine, read)
    truncated = len(succeeded) > MAX_EXPECTED
    succeeded = succeeded[:MAX_EXPECTED]
    refs = [op.provider_reference for op in succeeded if op.provider_reference]
    seen = ledger.seen_references(store, provider, refs)
    cutoff = now - policy.settlement_lag
    items = tuple(
        Expected(op, overdue=op.completed_at is not None and op.completed_at < cutoff)
        for op in succeeded
        if op.provider_reference not in seen
    )
    if flag:
        for item in items:
            if item.overdue and not item.operation.needs_attention:
                _flag_overdue(store, item.operation, policy, since, actor)
    oldest = min(
        (i.operation.completed_at for i in items if i.operation.completed_at), default=None
    )
    ledger.save_expected(
        store,
        {
            "provider": provider,
            "since": since,
            "lag_seconds": int(policy.settlement_lag.total_seconds()),
            "expected": len(items),
            "overdue": sum(1 for i in items if i.overdue),
            "oldest_expected_at": oldest,
        },
    )
    return ExpectedCheck(provider, since, now, items, truncated)


def _flag_overdue(
    store: Store, record: OperationRecord, policy: ReconPolicy, since: datetime, actor: str
) -> None:
    if any(e.kind == OVERDUE for e in store.events(record.tenant_id, record.id)):
        return  # flagged once already (and acknowledged since): never again
    detail = {
        "decision": "succeeded, and in no settlement report past the settlement lag: flagged",
        "settlement_lag_seconds": int(policy.settlement_lag.total_seconds()),
        "reports_since": since.isoformat(),
        "provider_reference": record.provider_reference,
    }
    with contextlib.suppress(StaleVersion):  # written since it was read: the next import looks
        store.flag_attention(record, kind=OVERDUE, actor=actor, detail=detail)
        metrics.escalated("evidence")
