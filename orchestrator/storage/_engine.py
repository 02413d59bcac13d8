"""Engines, transactions retried by SQLSTATE, and the one place database errors are mapped.

A write that fails before its COMMIT is issued did nothing (``StorageError``). A COMMIT
that raises without the server saying it rolled back may have committed
(``CommitUncertain``): the caller must answer "retry the same key", never "nothing happened".

On PostgreSQL the hot writes are single statements run in autocommit
(:func:`run_statement`, and SQL text on the driver connection: ``_driver_sql``): one round
trip each, no BEGIN/COMMIT. Such a statement is its own
COMMIT, so a failure without the server's verdict is uncertain in exactly the same way.
No pre-ping either: a pooled connection is checked locally at checkout (a closed socket is
seen without a round trip), and a connection that breaks inside a transaction before its
COMMIT is retried once on a fresh one. Each connection's first use checks that it reached a
read-write primary, and a commit whose synchronous-standby wait was cancelled is uncertain
too (:mod:`payorch.storage._sessions`).
"""

from __future__ import annotations

import os
import random
import re
import sqlite3
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import URL, Connection, Engine

from ..errors import (
    CommitUncertain,
    ConfigurationError,
    DatabaseUnavailable,
    SchemaNotReady,
    StorageError,
)
from ..forks import reset_in_child
from . import _sessions as sessions
from ._bridge import pause
from ._checkouts import configure_postgres
from ._pooling import Pooling, normalise_url, resolve
from ._pooling import configure as configure_pooling
from ._pooling import engine_options as pooling_options

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "create_async_engine",
    "create_engine",
    "map_db_error",
    "read_in_transaction",
    "run_in_transaction",
    "run_statement",
    "schema_of",
]

T = TypeVar("T")

# Serialization failure and deadlock: the transaction did nothing and may simply run again.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
_SQLITE_BUSY = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}
MAX_TRANSACTION_ATTEMPTS = 8
_WRITE_OPTION = "payorch_write"


_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
SCHEMAS: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()


def _schema(schema: str | None) -> str:
    # PAYORCH_DB_SCHEMA is read here, not through Settings: an engine must not fail on an
    # unrelated setting.
    name = schema if schema is not None else os.environ.get("PAYORCH_DB_SCHEMA") or "public"
    if not _SCHEMA_NAME.fullmatch(name):
        raise ConfigurationError(
            f"PostgreSQL schema {name!r}: use lower-case letters, digits and _ (max 63)"
        )
    return name


def schema_of(engine: Engine) -> str | None:
    """The PostgreSQL schema payorch's tables live in (None on SQLite)."""
    return SCHEMAS.get(engine)


def create_engine(
    url: str | URL,
    *,
    schema: str | None = None,
    pooler: str | None = None,
    listen_url: str | URL | None = None,
    **kwargs: Any,
) -> Engine:
    """An engine configured for payorch's concurrency on PostgreSQL or SQLite.

    On PostgreSQL, payorch's tables live in ``schema`` (default ``PAYORCH_DB_SCHEMA``, else
    ``public``): the connections' ``search_path`` names it, set at connect time so no
    statement pays for it. ``pooler`` and ``listen_url`` (defaults
    ``PAYORCH_DATABASE_POOLER``, ``PAYORCH_LISTEN_DATABASE_URL``) say whether ``url`` is a
    pooler and where waiters listen: :mod:`payorch.storage._pooling`.
    """
    parsed, name, pooling = _engine_options(url, schema, pooler, listen_url, kwargs)
    engine = sa.create_engine(parsed, **kwargs)
    _configure(engine, name, pooling)
    return engine


def create_async_engine(
    url: str | URL,
    *,
    schema: str | None = None,
    pooler: str | None = None,
    listen_url: str | URL | None = None,
    **kwargs: Any,
) -> AsyncEngine:
    """:func:`create_engine`'s twin for the async API: the same pool sizes, pragmas, BEGIN
    IMMEDIATE and schema, over psycopg's async driver or aiosqlite.

    The configuration attaches to ``engine.sync_engine``, the engine the sync store code
    runs on under :func:`payorch.storage._bridge.run_bridged`.
    """
    from sqlalchemy.ext.asyncio import create_async_engine as _create

    if _keeps_connections(url, kwargs):
        # Many operations in flight on one loop: the same ceiling of 30, kept open. Above a
        # pool of 10, connections would close on return and reopen under load (a connect,
        # its first-use check, statements never prepared).
        kwargs.update(pool_size=30, max_overflow=0)
    parsed, name, pooling = _engine_options(url, schema, pooler, listen_url, kwargs)
    if parsed.get_backend_name() == "sqlite":
        parsed = parsed.set(drivername="sqlite+aiosqlite")
        # aiosqlite runs each connection on its own thread; sqlite3's check has no say.
        kwargs["connect_args"] = {
            k: v for k, v in kwargs["connect_args"].items() if k != "check_same_thread"
        }
    engine = _create(parsed, **kwargs)
    _configure(engine.sync_engine, name, pooling)
    return engine


def _keeps_connections(url: str | URL, kwargs: dict[str, Any]) -> bool:
    """The async default pool applies: PostgreSQL, payorch's QueuePool, no size given."""
    given = {"poolclass", "pool_size", "max_overflow"} & kwargs.keys()
    return not given and normalise_url(url).get_backend_name() == "postgresql"


def _engine_options(
    url: str | URL,
    schema: str | None,
    pooler: str | None,
    listen_url: str | URL | None,
    kwargs: dict[str, Any],
) -> tuple[URL, str | None, Pooling]:
    """Fill ``kwargs`` with payorch's engine defaults; the URL, the PostgreSQL schema and
    the pooling."""
    parsed = normalise_url(url)
    pooled = "poolclass" not in kwargs  # sizes apply to the default QueuePool only
    if parsed.get_backend_name() == "sqlite":
        kwargs.setdefault("connect_args", {"check_same_thread": False, "timeout": 30})
        if pooled:
            kwargs.setdefault("pool_size", 8)
            kwargs.setdefault("max_overflow", 32)
            kwargs.setdefault("pool_timeout", 120)
        return parsed, None, Pooling()
    if pooled:
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 20)  # 30 connections: well under a server's 100
        kwargs.setdefault("pool_timeout", 60)
    # No pre-ping (a round trip per checkout): storage._checkouts checks the socket instead.
    kwargs.setdefault("pool_pre_ping", False)
    # The rollback on return is payorch's own (storage._checkouts): only what is open.
    kwargs.setdefault("pool_reset_on_return", None)
    name = _schema(schema)
    pooling = resolve(pooler, listen_url)
    # A transaction pooler refuses the startup option: there the server sets search_path.
    if name != "public" and not pooling.per_transaction:
        connect_args = dict(kwargs.pop("connect_args", {}))
        connect_args["options"] = f"{connect_args.get('options', '')} -c search_path={name}"
        kwargs["connect_args"] = connect_args
    pooling_options(pooling, kwargs)
    return parsed, name, pooling


def _configure(engine: Engine, schema: str | None, pooling: Pooling) -> None:
    if schema is None:
        _configure_sqlite(engine)
    else:
        SCHEMAS[engine] = schema
        configure_postgres(engine)
        configure_pooling(engine, pooling, schema)
    # A forked child starts with an empty pool of its own.
    reset_in_child(engine, _forget_connections)


def _forget_connections(engine: Engine) -> None:
    """In a forked child: a new pool; the parent's connections are dropped, not closed
    (closing would end the parent's sessions; the drivers' finalizers leave them alone)."""
    engine.dispose(close=False)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN IMMEDIATE: a deferred transaction that
        # later upgrades to a write lock can fail with SQLITE_BUSY without waiting.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is synced to disk before it returns. With WAL and NORMAL a committed
        # claim can vanish on power loss, and the client's retry would then claim a second
        # operation with a new downstream key.
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()
        # Bytes that are not UTF-8 in a TEXT column (written by something other than payorch)
        # would make sqlite3 fail the whole result, and so every reconciler pass: decode them
        # with U+FFFD instead, so the row reads, fails validation and is quarantined alone.
        # Under aiosqlite (the async API) the sqlite3 connection sits behind two adapters.
        target = getattr(dbapi_conn, "_connection", dbapi_conn)
        target.text_factory = _decode_text

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the lock up front; readers use WAL snapshots and never block a writer.
        write = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _decode_text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _is_retryable(err: exc.DBAPIError) -> bool:
    orig = err.orig
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in RETRYABLE_SQLSTATES:
        return True
    return isinstance(orig, sqlite3.OperationalError) and (
        getattr(orig, "sqlite_errorcode", None) in _SQLITE_BUSY
    )


def _missing_schema(err: exc.SQLAlchemyError) -> bool:
    orig = getattr(err, "orig", None)
    if getattr(orig, "sqlstate", None) in ("42P01", "42703"):  # undefined table, column
        return True
    text = str(orig)
    return isinstance(orig, sqlite3.OperationalError) and (
        "no such table" in text or "no such column" in text
    )


def map_db_error(err: exc.SQLAlchemyError) -> StorageError:
    if _missing_schema(err):
        # The statement named a table or column this database lacks: the schema is older
        # than this install (never migrated), or a newer payorch's migration changed it.
        # The database's own words name what is missing.
        return SchemaNotReady(
            f"payorch's tables do not match this release ({_first_line(err)}): if the "
            "database is older than this payorch, run `payorch db upgrade` against it; if a "
            "newer payorch migrated it, roll the code forward"
        )
    orig = getattr(err, "orig", None)
    if getattr(orig, "sqlstate", None) == "25006":  # read_only_sql_transaction
        return sessions.read_only_error(orig or err)
    if isinstance(err, exc.DBAPIError) and err.connection_invalidated:
        return DatabaseUnavailable(f"database connection lost: {err.orig}")
    if isinstance(err, exc.OperationalError):
        return DatabaseUnavailable(f"database unavailable: {err.orig}")
    if isinstance(err, exc.TimeoutError):
        return DatabaseUnavailable(f"no database connection available: {err}")
    return StorageError(f"database error: {getattr(err, 'orig', err)}")


def _first_line(err: exc.SQLAlchemyError) -> str:
    lines = str(getattr(err, "orig", None) or err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _commit_refused(err: exc.SQLAlchemyError) -> bool:
    """Whether a failed COMMIT certainly did not commit.

    PostgreSQL answers a COMMIT it cannot honour (a deferred constraint, a serialization
    failure) with an error carrying a SQLSTATE, and the transaction is rolled back. SQLite's
    SQLITE_BUSY on COMMIT leaves the transaction open, and it is rolled back on close. Any
    other failure (no answer, a cut connection, an I/O error) may follow a durable commit.
    """
    orig = getattr(err, "orig", None)
    if isinstance(err, exc.DBAPIError) and err.connection_invalidated:
        return False
    if getattr(orig, "sqlstate", None):
        return True
    return isinstance(orig, sqlite3.OperationalError) and (
        getattr(orig, "sqlite_errorcode", None) in _SQLITE_BUSY
    )


def _broken(err: exc.SQLAlchemyError) -> bool:
    return isinstance(err, exc.DBAPIError) and err.connection_invalidated


def _uncertain(err: exc.SQLAlchemyError) -> CommitUncertain:
    cause = getattr(err, "orig", None) or err
    return CommitUncertain(f"the database did not confirm a commit (it may have happened): {cause}")


def judge(
    err: exc.SQLAlchemyError, *, may_have_committed: bool, again_if_broken: bool, attempt: int
) -> None:
    """What a failed transaction or statement means, for every way payorch runs one: raises
    ``CommitUncertain`` if it may have committed without the server's verdict, returns (run
    it again) for a broken connection when allowed or a retryable SQLSTATE (after jitter),
    and raises the mapped ``StorageError`` otherwise."""
    if may_have_committed and not _commit_refused(err):
        raise _uncertain(err) from err
    if again_if_broken and _broken(err):
        return
    if (
        isinstance(err, exc.DBAPIError)
        and _is_retryable(err)
        and attempt + 1 < MAX_TRANSACTION_ATTEMPTS
    ):
        # On an event loop (the async API) this awaits instead of blocking the loop.
        pause(random.uniform(0, 0.01 * 2**attempt))  # noqa: S311 - jitter only
        return
    raise map_db_error(err) from err


def run_in_transaction(engine: Engine, fn: Callable[[Connection], T], *, write: bool = True) -> T:
    """Run ``fn`` in one transaction, again from the start on serialization failure/deadlock.

    ``write=False`` marks a read: on SQLite it starts a deferred transaction (a WAL
    snapshot) instead of taking the single write lock.

    Raises ``StorageError`` (nothing committed) for a failure before the COMMIT, and
    ``CommitUncertain`` for a write whose COMMIT raised without a verdict from the server.
    A connection that breaks before the COMMIT is sent committed nothing: the transaction
    runs once more on a fresh connection.
    """
    fresh_retry = True
    for attempt in range(MAX_TRANSACTION_ATTEMPTS):
        committing = False
        try:
            with engine.connect() as conn:
                conn.execution_options(**{_WRITE_OPTION: write})
                with conn.begin() as txn:
                    watch = sessions.session(conn)
                    result = fn(conn)
                    committing = True
                    txn.commit()
                if write:
                    sessions.after_commit(watch)
                return result
        except exc.SQLAlchemyError as err:
            judge(
                err,
                may_have_committed=committing and write,
                again_if_broken=fresh_retry,
                attempt=attempt,
            )
            # The pool has dropped a broken one; once only, so a dead server fails.
            fresh_retry = fresh_retry and not _broken(err)
    raise StorageError("transaction retries exhausted")  # pragma: no cover - loop returns/raises


def run_statement(engine: Engine, fn: Callable[[Connection], T], *, write: bool = True) -> T:
    """Run ``fn``, a single statement, as its own transaction: autocommit, one round trip.

    For PostgreSQL (SQLite keeps :func:`run_in_transaction` and its BEGIN IMMEDIATE). The
    statement is its own COMMIT: a failure the server answered with an error (a SQLSTATE,
    connection intact) committed nothing and is retried like a transaction when retryable;
    a write that failed without that verdict (connection lost after it may have been sent)
    raises ``CommitUncertain``. A connection found dead before anything was sent (checked
    at checkout) is replaced by the pool and nothing is uncertain.
    """
    for attempt in range(MAX_TRANSACTION_ATTEMPTS):
        sent = False
        try:
            with engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                watch = sessions.session(conn)
                sent = True
                result = fn(conn)
            if write:
                sessions.after_commit(watch)
            return result
        except exc.SQLAlchemyError as err:
            # Broken before our statement, or a broken read: nothing to be uncertain
            # about, once more on a fresh connection.
            judge(
                err,
                may_have_committed=sent and write,
                again_if_broken=(not sent or not write) and attempt == 0,
                attempt=attempt,
            )
    raise StorageError("statement retries exhausted")  # pragma: no cover - loop returns/raises


def read_in_transaction(engine: Engine, fn: Callable[[Connection], T]) -> T:
    """A consistent read, errors mapped like writes, never holding SQLite's write lock."""
    return run_in_transaction(engine, fn, write=False)
