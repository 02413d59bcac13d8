"""The durable store: claim, replay, fenced transitions and the append-only event log.

Every write is one statement guarded by a constraint or a version:

* the claim is ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` on the namespace key;
* a transition is ``UPDATE ... WHERE version = :v RETURNING`` plus its event row, in one
  transaction; a lost compare-and-set raises :class:`StaleVersion` and changes nothing.

On PostgreSQL the claim and the plain transitions are each one data-modifying statement run
in autocommit (``_statements.PG_CLAIM``, ``pg_transition_sql``): one round trip apiece. Times
are the database's (``db_now``), so hosts with skewed clocks agree on leases. A terminal
transition that stages outbox messages (``_outbox.OutboxHooks``) writes them in its own
transaction."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Engine

from ..core import State
from ..errors import (
    CommitUncertain,
    IdempotencyKeyExpired,
    IdempotencyKeyReused,
    OperationInProgress,
    StaleVersion,
)
from ..forks import reset_in_child
from ..records import ClaimResult, NewOperation, OperationRecord
from . import _pg_writes as pg_writes
from . import _probes as probes
from . import _replication as replication
from ._claims import claim_detail, claim_uncertain, duplicate_kind, look_again_after
from ._distribution import Placed, distributed_if_known
from ._engine import create_engine, run_in_transaction, run_statement, schema_of
from ._folded import claim_event
from ._outbox import OutboxHooks
from ._pooling import listen_dsn
from ._reads import Reads
from ._replays import Replays
from ._schema import SchemaCheck
from ._statements import (
    PG_CLAIMED,
    PG_EXISTING,
    REPLAY_BY_NAMESPACE,
    Shape,
    add_event,
    build_claim,
    new_id,
)
from ._tables import db_now, operations
from ._transitions import Transitions
from ._waiting import NOTIFY_CHANNEL, Listener, wait_until_settled
from ._work_queue import QUARANTINE_EVENT, QUARANTINE_HOLD, WorkQueue

__all__ = ["NOTIFY_CHANNEL", "QUARANTINE_EVENT", "QUARANTINE_HOLD", "Store", "new_id"]

_UNSET: Any = object()

_PG_CLAIM_ATTEMPTS = 3  # then the general transaction decides
_TAKE_OVER_ATTEMPTS = 3  # racing requests for one released operation: then "in progress"


class Store(Reads, Replays, Transitions, WorkQueue, SchemaCheck, Placed):
    """Operations and their events on PostgreSQL or SQLite."""

    def __init__(
        self,
        engine: Engine,
        *,
        require_sync_standby: bool | None = None,
        outbox_hooks: OutboxHooks | None = None,
    ) -> None:
        self.engine, self.dialect = engine, engine.dialect.name
        self.outbox_hooks = outbox_hooks  # what settling stages, in the same transaction
        self.replication = replication.Guard(engine, require_sync_standby=require_sync_standby)
        # Hot statements are built once: SQLAlchemy then skips coercion and cache-key work.
        self._claim_stmt = build_claim(
            postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        )
        self._updates: dict[Shape, Any] = {}
        self._pg_updates: dict[Any, str] = {}
        self._listener: Listener | None = None
        self._listener_lock = threading.Lock()
        reset_in_child(self, Store._forget_listener)

    def _forget_listener(self) -> None:
        # In a forked child the LISTEN connection is the parent's: dropped, not closed.
        self._listener = None
        self._listener_lock = threading.Lock()

    @classmethod
    def from_url(
        cls, url: str | URL, *, outbox_hooks: OutboxHooks | None = None, **kw: Any
    ) -> Store:
        return cls(create_engine(url, **kw), outbox_hooks=outbox_hooks)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        self.engine.dispose()

    def listener(self) -> Listener | None:
        """The shared LISTEN connection for waiters, started on first use; None where they
        poll (SQLite; a transaction pooler with no ``listen_url``:
        :mod:`payorch.storage._pooling`)."""
        if not self.is_postgres:
            return None
        with self._listener_lock:
            if self._listener is None:
                dsn = listen_dsn(self.engine)
                if dsn is None:
                    return None
                schema = schema_of(self.engine)
                self._listener = Listener(
                    dsn,  # a libpq conninfo: multi-host and target_session_attrs included
                    # It reads for woken waiters, on its own connection: payorch's tables.
                    # (What is known, no I/O: an async waiter may be on the loop here.)
                    reader=(
                        pg_writes.reread_for_distributed
                        if distributed_if_known(self.engine)
                        else pg_writes.reread_for
                    ),
                    options=f"-c search_path={schema}" if schema not in (None, "public") else None,
                )
            return self._listener

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    def read_gauges(self) -> dict[str, Any]:
        """The state gauges' numbers, by the database clock, in one read (the active and
        attention partial indexes); on PostgreSQL the replication mode too."""
        return probes.read_gauges(self)

    # -- claim ------------------------------------------------------------------------

    def claim(
        self,
        new: NewOperation,
        *,
        owner: str,
        lease: timedelta,
        possibly_sent: bool = False,
        wait: timedelta | None = None,
    ) -> ClaimResult:
        """Claim the namespace or return what already holds it.

        New namespace: the operation row (``in_progress``, lease held by ``owner``, downstream
        key) and its ``claimed`` event are committed before this returns. Existing namespace:
        replay a terminal outcome, return an ``outcome_unknown`` one as it stands, refuse a
        changed fingerprint, or report/wait for one in progress (``wait`` bounds the wait).
        ``possibly_sent=True`` records, in the same commit, that the caller is about to send.
        A released operation (nothing was sent before, :attr:`OperationRecord.released`) is
        taken over, same fingerprint and downstream key, and returned as ``created``.
        """
        ends = time.monotonic() + wait.total_seconds() if wait is not None else None
        for _ in range(_TAKE_OVER_ATTEMPTS):
            left = None if ends is None else timedelta(seconds=max(0.0, ends - time.monotonic()))
            result = self._claim_once(
                new, owner=owner, lease=lease, possibly_sent=possibly_sent, wait=left
            )
            if not result.released:
                return result
            try:
                return self._take_over(result.operation, new, owner, lease, possibly_sent)
            except StaleVersion:
                continue  # another request took it over first: judge the namespace again
        raise OperationInProgress(
            f"operation {result.operation.id} is being taken over by another request",
            operation_id=result.operation.id,
            retry_after=1.0,
        )

    def _take_over(
        self,
        record: OperationRecord,
        new: NewOperation,
        owner: str,
        lease: timedelta,
        possibly_sent: bool,
    ) -> ClaimResult:
        """Run a released operation again under this claim: the lease and the attempt to
        come, fenced by version (one of several racing requests wins). The request stored
        is this one (same fingerprint; what is sent now). Another provider is refused: the
        namespace's key may already be known to the first one (a claim lost in a failover),
        and a second acquirer would be a second charge."""
        # A routed operation keeps the route it was stored with: it resumes at its current
        # provider, whichever the request would be routed to now.
        if new.provider != record.provider and record.route is None:
            raise IdempotencyKeyReused(
                f"idempotency key {new.idempotency_key!r} was first used with provider "
                f"{record.provider!r}, not {new.provider!r}; nothing was executed",
                operation_id=record.id,
            )
        taken = self.transition(
            record,
            State.IN_PROGRESS,
            kind="reclaimed",
            actor=owner,
            detail=claim_detail(new, reason="nothing was sent before: the same key runs again"),
            lease=lease,
            lease_owner=owner,
            possibly_sent=possibly_sent,
            attempts_delta=1 if possibly_sent else 0,
            request=dict(new.request) if new.request is not None else None,
        )
        return ClaimResult(operation=taken, created=True)

    def _claim_once(
        self,
        new: NewOperation,
        *,
        owner: str,
        lease: timedelta,
        possibly_sent: bool,
        wait: timedelta | None,
    ) -> ClaimResult:
        op_id = new_id()
        lease_s = lease.total_seconds()
        if self.is_postgres:
            fast = self._claim_pg(new, op_id, owner, lease_s, possibly_sent)
            if fast is not None:
                record, created, lease_remaining = fast
                if created:
                    return ClaimResult(operation=record, created=True)
                return self._existing(record, new, lease_remaining, wait)

        params = {
            "c_tenant_id": new.tenant_id,
            "c_id": op_id,
            "c_operation": new.operation,
            "c_idempotency_key": new.idempotency_key,
            "c_fingerprint": new.fingerprint,
            "c_state": State.IN_PROGRESS.value,
            "c_provider": new.provider,
            "c_downstream_key": new.downstream_key,
            "c_amount": new.amount,
            "c_currency": new.currency,
            "c_request": dict(new.request) if new.request is not None else None,
            "c_retention_seconds": int(new.retention.total_seconds()),
            "c_possibly_sent": possibly_sent,
            "c_attempts": 1 if possibly_sent else 0,
            "c_lease_owner": owner,
            "c_lease_s": lease_s,
            # The claim's event is kept on the row (see _folded.py), not as an event row.
            "c_claim_event": claim_event(owner, claim_detail(new)),
            "c_route": dict(new.route) if new.route is not None else None,
        }

        replay_params = {
            "r_tenant_id": new.tenant_id,
            "r_operation": new.operation,
            "r_idempotency_key": new.idempotency_key,
            "r_fingerprint": new.fingerprint,
        }
        attempted: list[tuple[OperationRecord, bool, float]] = []  # what the COMMIT carried

        def txn(conn: Connection) -> tuple[OperationRecord, bool, float]:
            attempted.clear()  # a retried transaction starts over
            row = conn.execute(self._claim_stmt, params).mappings().first()
            if row is not None:
                record = OperationRecord.from_row(row)
                attempted.append((record, True, 0.0))
                return record, True, 0.0
            # A replay (the common duplicate) is read and counted by one statement; only
            # what is not a replay is read as it stands.
            found = conn.execute(REPLAY_BY_NAMESPACE, replay_params).mappings().first()
            counted = found is not None
            if found is None:
                found = (
                    conn.execute(
                        sa.select(operations, db_now().label("_now")).where(
                            operations.c.tenant_id == new.tenant_id,
                            operations.c.operation == new.operation,
                            operations.c.idempotency_key == new.idempotency_key,
                        )
                    )
                    .mappings()
                    .one()
                )
            existing = OperationRecord.from_row(found)
            remaining = 0.0
            if existing.lease_expires_at is not None:
                remaining = (existing.lease_expires_at - found["_now"]).total_seconds()
            # Conflicts go to the operation's log (stats, audit); replays are only counted
            # on the row (replays, last_replayed_at), never logged one by one.
            noted = duplicate_kind(existing, new)
            if noted == "replayed" and not counted:
                # It became terminal between the two reads (PostgreSQL reads each statement
                # afresh): count this replay too.
                existing = self._count_replay(conn, existing) or existing
            elif noted is not None and noted != "replayed":
                add_event(
                    conn,
                    existing,
                    kind=noted,
                    actor=owner,
                    from_state=None,
                    to_state=None,
                    detail={"offered_fingerprint": new.fingerprint},
                )
            attempted.append((existing, False, remaining))
            return existing, False, remaining

        try:
            record, created, lease_remaining = run_in_transaction(self.engine, txn)
        except CommitUncertain as exc:
            if not attempted or attempted[0][1]:
                raise claim_uncertain(new, op_id) from exc
            # Someone else's operation holds the namespace; only our audit event is in doubt.
            record, created, lease_remaining = attempted[0]
        if created:
            return ClaimResult(operation=record, created=True)
        return self._existing(record, new, lease_remaining, wait)

    def _claim_pg(
        self, new: NewOperation, op_id: str, owner: str, lease_s: float, possibly_sent: bool
    ) -> tuple[OperationRecord, bool, float] | None:
        """The claim on PostgreSQL: the claim, or replay counted, or the row, in one
        statement committed on its own (one round trip). None when the statement could not
        decide (a racing duplicate it cannot see, or a replay it did not count): the caller
        then runs the general transaction."""
        for _ in range(_PG_CLAIM_ATTEMPTS):
            try:
                found = pg_writes.claim(
                    self.engine,
                    new,
                    op_id=op_id,
                    owner=owner,
                    lease_s=lease_s,
                    possibly_sent=possibly_sent,
                )
            except CommitUncertain as exc:
                raise claim_uncertain(new, op_id) from exc
            if found is not None:
                break
            # A racing duplicate committed the namespace after our snapshot was taken: we
            # inserted nothing and saw nothing. A new statement (a new snapshot) sees it.
        else:
            return None
        kind, record, now = found
        if kind == PG_CLAIMED:
            return record, True, 0.0
        noted = duplicate_kind(record, new)
        if kind == PG_EXISTING and noted == "replayed":
            return None  # terminal, yet not counted (reaped meanwhile?): judge it afresh
        remaining = 0.0
        if record.lease_expires_at is not None:
            remaining = (record.lease_expires_at - now).total_seconds()
        if noted is not None and noted != "replayed":
            # Conflicts go to the operation's log (stats, audit): a statement of its own.
            detail = {"offered_fingerprint": new.fingerprint}
            with contextlib.suppress(CommitUncertain):  # only our audit event is in doubt
                run_statement(
                    self.engine,
                    lambda conn: add_event(
                        conn,
                        record,
                        kind=noted,
                        actor=owner,
                        from_state=None,
                        to_state=None,
                        detail=detail,
                    ),
                )
        return record, False, remaining

    def _existing(
        self,
        record: OperationRecord,
        new: NewOperation,
        lease_remaining: float,
        wait: timedelta | None,
    ) -> ClaimResult:
        if record.reaped_at is not None:
            raise IdempotencyKeyExpired(
                f"idempotency key {new.idempotency_key!r} is past its retention window",
                operation_id=record.id,
            )
        if record.fingerprint != new.fingerprint:
            raise IdempotencyKeyReused(
                f"idempotency key {new.idempotency_key!r} was first used with other effect "
                "fields; nothing was executed",
                operation_id=record.id,
            )
        if record.state is State.IN_PROGRESS and wait is not None and wait > timedelta(0):
            # Each look counts the replay the wait ends in, like any other replay.
            record = wait_until_settled(self, record, wait, reread=self._reread)
            if record.state is State.IN_PROGRESS and record.lease_expires_at is not None:
                lease_remaining = (record.lease_expires_at - self.db_time()).total_seconds()
        if record.terminal:
            return ClaimResult(operation=record, created=False, replayed=True)
        if record.state is State.OUTCOME_UNKNOWN:
            return ClaimResult(operation=record, created=False)
        if record.released:
            return ClaimResult(operation=record, created=False, released=True)
        raise OperationInProgress(
            f"operation {record.id} is in progress",
            operation_id=record.id,
            retry_after=look_again_after(record, lease_remaining),
        )

    # -- waiting ----------------------------------------------------------------------

    def wait_until_settled(self, record: OperationRecord, wait: timedelta) -> OperationRecord:
        """Wait up to ``wait`` for ``record`` to leave ``in_progress``; return it as it is then
        (PostgreSQL waiters sleep on LISTEN/NOTIFY; SQLite waiters poll with backoff)."""
        return wait_until_settled(self, record, wait)

    def _insert(self, table: sa.Table) -> Any:
        return postgresql.insert(table) if self.is_postgres else sqlite.insert(table)
