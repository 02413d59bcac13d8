"""The pool's side of payorch's PostgreSQL engines: what happens at checkout and on return.

At checkout a pooled connection is checked locally (a closed socket is seen without a round
trip: no pre-ping) and given back the mode SQLAlchemy expects, since :func:`run_sql
<payorch.storage._driver_sql.run_sql>` leaves its connections in autocommit. On return, only
what is open is rolled back.
"""

from __future__ import annotations

import select
from contextvars import ContextVar
from typing import Any

from sqlalchemy import event, exc
from sqlalchemy.engine import Engine
from sqlalchemy.pool.base import reset_none

__all__ = ["RAW_CHECKOUT", "configure_postgres", "runs_on_driver"]

_IDLE_READS = 4
_IDLE = 0  # libpq PQTRANS_IDLE (psycopg.pq.TransactionStatus.IDLE): no transaction open

# Set while run_sql checks a connection out: the checkout listener then leaves autocommit on.
# A context variable, not a thread-local: under the async bridge many greenlets share a
# thread, and a checkout may await (open a connection) while another greenlet checks out.
RAW_CHECKOUT: ContextVar[bool] = ContextVar("payorch_raw_checkout", default=False)


def runs_on_driver(engine: Engine) -> bool:
    """Whether :func:`run_sql` runs on the pooled driver connection itself (psycopg, sync or
    async); elsewhere it goes through SQLAlchemy and never leaves autocommit on."""
    return engine.dialect.driver == "psycopg"  # "postgresql+psycopg", sync or async


def configure_postgres(engine: Engine) -> None:
    raw_path = runs_on_driver(engine)
    if engine.pool._reset_on_return is reset_none:  # payorch's default (_engine_options)
        _reset_what_is_open(engine)
    # The mode SQLAlchemy gives a fresh connection of this engine (its isolation_level).
    natural = getattr(engine.dialect, "_on_connect_isolation_level", None) == "AUTOCOMMIT"

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        # The pool then discards it and checks out (or opens) another.
        if not _pg_alive(dbapi_conn):
            raise exc.DisconnectionError("pooled PostgreSQL connection found closed")
        # run_sql leaves its connections in autocommit, the mode its statements need, so
        # the hot path switches no mode per statement; every other user gets the mode
        # SQLAlchemy expects back (the driver's transactions, unless the engine's own
        # isolation_level is AUTOCOMMIT).
        if raw_path and dbapi_conn.autocommit != natural and not RAW_CHECKOUT.get():
            try:
                dbapi_conn.autocommit = natural
            except Exception as err:  # psycopg.Error: closed or broken meanwhile
                raise exc.DisconnectionError(f"pooled PostgreSQL connection broke: {err}") from err


def _reset_what_is_open(engine: Engine) -> None:
    """The pool's rollback on return, skipped where nothing is open: run_sql's connections
    come back idle in autocommit, where a rollback is a no-op that still costs a call into
    the driver (an await, on the async one) per statement. Any other state (a transaction
    open, failed or unknown) is rolled back as the pool's default reset would."""

    @event.listens_for(engine, "reset")
    def _on_reset(dbapi_conn: Any, _record: Any, state: Any) -> None:
        if state.terminate_only or not state.asyncio_safe or state.transaction_was_reset:
            return  # being discarded, or not ours to touch now, or already rolled back
        driver = getattr(dbapi_conn, "_connection", dbapi_conn)  # the async adapter wraps it
        if driver.info.transaction_status != _IDLE:
            dbapi_conn.rollback()


def _pg_alive(dbapi_conn: Any) -> bool:
    """Whether an idle pooled psycopg connection is still open, without a round trip.

    An idle connection has nothing to read. If its socket is readable, the server has
    spoken or hung up (a terminated backend sends its FATAL, then closes): read it, and a
    closed connection shows. Sending a statement there first would make its failure look
    like one after sending, i.e. uncertain.
    """
    conn = getattr(dbapi_conn, "_connection", dbapi_conn)  # the async adapter wraps it
    pgconn = getattr(conn, "pgconn", None)
    if pgconn is None:  # pragma: no cover - not psycopg: nothing to look at
        return True
    if conn.closed or getattr(conn, "broken", False):
        return False
    try:
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        # A FATAL message first, then the end of the stream: read until nothing is left.
        for _ in range(_IDLE_READS):
            if not poller.poll(0):
                break
            pgconn.consume_input()
        else:
            return False  # an idle connection that keeps talking is not one to trust
    except Exception:  # noqa: BLE001 - psycopg.OperationalError or OSError: it is dead
        return False
    return bool(pgconn.status == 0)  # CONNECTION_OK
