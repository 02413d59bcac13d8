"""Bounded waits for an operation in progress to settle.

PostgreSQL waiters sleep on LISTEN/NOTIFY (the store NOTIFYs on every move out of
``in_progress``); SQLite waiters poll with backoff.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

import psycopg

from .core import State
from .errors import DatabaseUnavailable
from .records import OperationRecord

if TYPE_CHECKING:
    from .store import Store

__all__ = ["NOTIFY_CHANNEL", "wait_until_settled"]

NOTIFY_CHANNEL = "payorch_operations"


def wait_until_settled(store: Store, record: OperationRecord, wait: timedelta) -> OperationRecord:
    deadline = time.monotonic() + wait.total_seconds()
    if store.is_postgres:
        return _wait_notify(store, record, deadline)
    delay = 0.02
    current = store.get(record.tenant_id, record.id)
    while current.state is State.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)
        current = store.get(record.tenant_id, record.id)
    return current


def _wait_notify(store: Store, record: OperationRecord, deadline: float) -> OperationRecord:
    # A dedicated connection, outside the pool: a crowd of waiters must never starve the
    # lease holder of the connection it needs to record the outcome.
    dsn = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    wanted = f"{record.tenant_id}:{record.id}"
    state_sql = "SELECT state FROM payorch_operations WHERE tenant_id = %s AND id = %s"
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as pg:
            pg.execute(f"LISTEN {NOTIFY_CHANNEL}")
            # Read after LISTEN: a NOTIFY sent before it would otherwise be missed.
            while True:
                row = pg.execute(state_sql, (record.tenant_id, record.id)).fetchone()
                remaining = deadline - time.monotonic()
                if row is None or row[0] != State.IN_PROGRESS.value or remaining <= 0:
                    break
                for note in pg.notifies(timeout=min(remaining, 1.0)):
                    if note.payload == wanted:
                        break
    except psycopg.Error as exc:
        raise DatabaseUnavailable(f"cannot wait for operation {record.id}: {exc}") from exc
    return store.get(record.tenant_id, record.id)
