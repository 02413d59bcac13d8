"""The database reads of monitoring: scrape-time gauges and readiness probes.

Plain reads of a store; a scrape or a probe waits for one at most a time-out
(:class:`payorch.observing._bounded.OneAtATime` runs them), so they need not be quick.
"""

from __future__ import annotations

from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..core import State
from ..errors import DatabaseReadOnly
from ._engine import read_in_transaction
from ._replication import MODES, Guard, Status
from ._tables import db_now, effects, is_active, is_dead, is_flagged, is_pending, operations, outbox

__all__ = ["Probed", "read_gauges", "replication"]


class Probed(Protocol):
    """What a probe reads through (a :class:`~payorch.Store`)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def is_postgres(self) -> bool: ...

    @property
    def replication(self) -> Guard: ...


def read_gauges(store: Probed) -> dict[str, Any]:
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
    o = outbox.c
    # The outbox's backlog and dead letters (each its own partial index), and the effects
    # of payorch.once waiting for a human.
    pending = sa.select(
        sa.func.count(),
        sa.func.count().filter(o.next_attempt_at <= db_now()),
        sa.func.min(o.created_at),
    ).where(is_pending())
    dead = sa.select(sa.func.count()).select_from(outbox).where(is_dead())
    effects_flagged = (
        sa.select(sa.func.count()).select_from(effects).where(sa.and_(effects.c.needs_attention))
    )

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
        waiting, due_messages, oldest_message = conn.execute(pending).one()
        message_age = (now - oldest_message).total_seconds() if oldest_message else 0.0
        return {
            "by_state": by_state,
            "due": due_now,
            "attention": int(conn.execute(flagged).scalar_one()),
            "oldest_unknown_age": max(age, 0.0),
            "outbox": {
                "pending": int(waiting),
                "due": int(due_messages),
                "dead": int(conn.execute(dead).scalar_one()),
                "oldest_pending_age": max(message_age, 0.0),
            },
            "effects_attention": int(conn.execute(effects_flagged).scalar_one()),
        }

    values = read_in_transaction(store.engine, read)
    if store.is_postgres:  # the replication gauges: one statement more
        status = replication(store)
        values["replication"] = {
            "mode": status.mode,
            "modes": MODES,
            "sync_standbys": status.sync_standbys_streaming,
            "standbys": status.standbys_streaming,
        }
    return values


def replication(store: Probed) -> Status:
    """The store's replication status; ``read_only`` (not an error) for a standby or a
    read-only session, so a probe can say so."""
    try:
        return store.replication.status()
    except DatabaseReadOnly:
        return Status(mode="read_only")
