"""Bounded reads of the database for monitoring: scrape-time gauges and readiness probes.

A scrape or a probe must answer even when the database does not: each read runs on a worker
thread and is waited for at most a time-out, and while one is stuck no other is started.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import sqlalchemy as sa

from ..core import State
from ..errors import DatabaseReadOnly
from ..forks import reset_in_child
from ._engine import read_in_transaction
from ._replication import Status
from ._tables import db_now, is_active, is_flagged, operations

if TYPE_CHECKING:
    from ._store import Store

__all__ = ["OneAtATime", "ping", "read_gauges", "replication"]

T = TypeVar("T")


class OneAtATime(Generic[T]):
    """Calls ``fn`` on a worker thread and waits at most ``timeout``; ``None`` on failure or
    time-out. While an earlier call is still stuck (a hung database), answers ``None`` at
    once instead of starting another: scrapes and probes never pile threads up."""

    def __init__(self, fn: Callable[[], T], *, timeout: float) -> None:
        self.fn = fn
        self.timeout = timeout
        self._start()
        # A forked child has no thread behind a call in flight at the fork.
        reset_in_child(self, OneAtATime._start)

    def _start(self) -> None:
        self._lock = threading.Lock()
        self._inflight: Future[T] | None = None

    def __call__(self) -> T | None:
        with self._lock:
            if self._inflight is not None and not self._inflight.done():
                return None
            future: Future[T] = Future()
            self._inflight = future

        def run() -> None:
            try:
                future.set_result(self.fn())
            except Exception as exc:  # noqa: BLE001 - any failure reads as "no answer"
                future.set_exception(exc)

        threading.Thread(target=run, name="payorch-monitor-read", daemon=True).start()
        try:
            return future.result(timeout=self.timeout)
        except Exception:  # noqa: BLE001 - time-out or database error: no answer
            return None


def read_gauges(store: Store) -> dict[str, Any]:
    """The scrape-time numbers, by the database clock, in one read transaction.

    Non-terminal rows only (``is_active()``: the active partial index, so the cost follows
    the stuck work, not the table); the attention count reads its own partial index.
    Terminal counts are left out on purpose: counting them reads the whole table.
    """
    t = operations.c
    due = sa.and_(
        t.next_check_at <= db_now(),
        sa.or_(t.lease_expires_at.is_(None), t.lease_expires_at <= db_now()),
    )
    active = (
        sa.select(t.state, sa.func.count(), sa.func.count().filter(due), sa.func.min(t.created_at))
        .where(is_active())
        .group_by(t.state)
    )
    flagged = sa.select(sa.func.count()).select_from(operations).where(is_flagged())

    def read(conn: sa.Connection) -> dict[str, Any]:
        now = conn.execute(sa.select(db_now())).scalar_one()
        by_state = {State.IN_PROGRESS.value: 0, State.OUTCOME_UNKNOWN.value: 0}
        due_now, oldest_unknown = 0, None
        for state, count, due_count, oldest in conn.execute(active).all():
            by_state[str(state)] = int(count)
            due_now += int(due_count)
            if state == State.OUTCOME_UNKNOWN.value:
                oldest_unknown = oldest
        age = (now - oldest_unknown).total_seconds() if oldest_unknown is not None else 0.0
        return {
            "by_state": by_state,
            "due": due_now,
            "attention": int(conn.execute(flagged).scalar_one()),
            "oldest_unknown_age": max(age, 0.0),
        }

    values = read_in_transaction(store.engine, read)
    if store.is_postgres:  # the replication gauges: one statement more
        values["replication"] = replication(store)
    return values


def replication(store: Store) -> Status:
    """The store's replication status; ``read_only`` (not an error) for a standby or a
    read-only session, so a probe can say so."""
    try:
        return store.replication.status()
    except DatabaseReadOnly:
        return Status(mode="read_only")


def ping(store: Store) -> bool:
    """One round trip: the database answers."""
    read_in_transaction(store.engine, lambda conn: conn.execute(sa.select(db_now())).scalar_one())
    return True
