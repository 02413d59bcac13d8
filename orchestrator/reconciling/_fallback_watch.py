"""The reconciler daemon's scheduled look at the providers routed operations moved away from
(or passed over as unhealthy).

A routed operation that settled at its next provider is no longer due for any check, yet
the provider it left may still surface an effect (an overturned decline, a request that
arrived late). Each run reads the moves (``fallback`` events, by a partial index of their
own) that reached one of the ``ages`` since the previous run, and asks their earlier
providers again (:class:`~payorch.reconciling._crossings.CrossCheck`). So each move is
looked at a handful of times over a day, not every run. The watermark is this process's:
bands that pass while no daemon runs are not looked at again (the unexplained-effects look
and the settlement reports remain).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import OperationNotFound, PayorchError
from ..observing import _logs as logs
from ..storage._engine import read_in_transaction
from ..storage._store import Store
from ..storage._tables import WATCHED, events
from ._crossings import CrossCheck

__all__ = ["DEFAULT_AGES", "FallbackWatch"]

# When a move is looked at again, after it was made.
DEFAULT_AGES = (
    timedelta(minutes=2),
    timedelta(minutes=15),
    timedelta(hours=1),
    timedelta(hours=6),
    timedelta(hours=24),
    timedelta(hours=72),
)


@dataclass(kw_only=True)
class FallbackWatch:
    """Asks, every ``every``, the earlier providers of the moves that reached an age in
    ``ages`` since the last run (the first run looks back ``every``); only the tenants in
    ``tenant_ids`` when given (a sharded daemon's)."""

    store: Store
    crossings: CrossCheck
    every: timedelta = timedelta(minutes=1)
    ages: Sequence[timedelta] = DEFAULT_AGES
    tenant_ids: Collection[str] | None = None
    page: int = 1000  # moves read per statement
    _last: datetime | None = field(default=None, init=False)

    def run(self) -> dict[str, int]:
        """One look; the results counted (``clear``, ``flagged``, ``voided``, …)."""
        now = self.store.db_time()
        since = self._last or now - self.every
        moves: set[tuple[str, str]] = set()
        for age in self.ages:
            moves |= self.moved_between(since - age, now - age)
        self._last = now  # only once every band was read whole: a failed read is read again
        return self.check(moves)

    def moved_between(self, start: datetime, end: datetime) -> set[tuple[str, str]]:
        """(tenant, operation id) of the moves made in ``(start, end]``: every one, read a
        page at a time (an outage makes many moves at once)."""
        e = events.c
        found: set[tuple[str, str]] = set()
        after: tuple[datetime, str] | None = None
        while True:
            query = (
                sa.select(e.tenant_id, e.operation_id, e.created_at, e.id)
                .where(sa.text(WATCHED), e.created_at > start)
                .where(e.created_at <= end)
                .order_by(e.created_at, e.id)
                .limit(self.page)
            )
            if after is not None:
                query = query.where(sa.tuple_(e.created_at, e.id) > sa.tuple_(*after))
            if self.tenant_ids is not None:
                query = query.where(e.tenant_id.in_(sorted(self.tenant_ids)))
            rows = read_in_transaction(self.store.engine, functools.partial(_rows, query))
            found.update((str(r[0]), str(r[1])) for r in rows)
            if len(rows) < self.page:
                return found
            after = (rows[-1][2], str(rows[-1][3]))

    def check(self, moves: Collection[tuple[str, str]]) -> dict[str, int]:
        """Ask the providers each of ``moves`` (tenant, operation id) left; results counted."""
        counts: dict[str, int] = {}
        for tenant_id, operation_id in sorted(moves):
            try:
                record = self.store.get(tenant_id, operation_id)
            except OperationNotFound:
                continue
            except PayorchError as exc:  # unreadable here (corrupt, the database away)
                logs.reconciler_log.warning("routed operation %s unread: %s", operation_id, exc)
                counts["check_error"] = counts.get("check_error", 0) + 1
                continue
            try:
                results = self.crossings.check(record)
            except Exception as exc:  # noqa: BLE001 - one operation must not stop the look
                logs.reconciler_log.warning(
                    "cross-provider check of %s failed: %s", operation_id, exc
                )
                results = ["check_error"]
            for result in results:
                counts[result] = counts.get(result, 0) + 1
        return counts


def _rows(query: sa.Select[Any], conn: Connection) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in conn.execute(query)]
