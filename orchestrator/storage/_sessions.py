"""The database sessions payorch uses: on a primary, read-write, atomic where it needs it.

Once per pooled PostgreSQL connection, on its first use by payorch (:mod:`payorch.db`):

* it must have reached a primary in a read-write session. A standby (``pg_is_in_recovery()``)
  or a read-only session (``default_transaction_read_only``) is a configuration error,
  :class:`~payorch.errors.DatabaseReadOnly`, at once: never a stale read, never a write
  that fails later for a reason nobody sees;
* a notice handler (a :class:`Watch`) is installed on it. A commit whose wait for a
  synchronous standby was cancelled (``pg_cancel_backend``, a statement time-out, a
  pooler's cancel) is reported by PostgreSQL as a success plus a WARNING, though it exists
  on the primary alone and a failover loses it. After every write payorch looks at the
  watch (an attribute read); if that warning came, the commit is uncertain
  (:func:`wait_cancelled`), so no provider call follows it.

An engine whose connections run in autocommit (``isolation_level="AUTOCOMMIT"``) cannot
give payorch's multi-statement transactions their atomicity: :func:`refuse_autocommit`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import URL, Connection, Engine

from ..errors import CommitUncertain, ConfigurationError, DatabaseReadOnly, StorageError

__all__ = [
    "ROLE_SQL",
    "Watch",
    "adopt",
    "after_commit",
    "citus_seen",
    "conninfo",
    "first_use",
    "read_only_error",
    "refuse_autocommit",
    "session",
    "wait_cancelled",
    "watch_of",
]

# One round trip per new connection: is it a primary, may this session write, and is Citus
# there (then the store reads how its tables are placed: payorch._distribution)?
ROLE_SQL = (
    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), "
    "to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL"
)
# Per pool (so per engine): whether its connections reached a database with Citus.
_CITUS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_KEY = "payorch_session"  # in the pool's per-connection info (cleared on reconnect)
_TARGET = "point the URL at the primary, or list every host with target_session_attrs=read-write"


class Watch:
    """The notice handler of one connection: remembers the warning of a cancelled wait
    for synchronous replication until payorch looks after its statement."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: str | None = None

    def __call__(self, diag: Any) -> None:
        # The server's words (syncrep.c: "canceling wait for synchronous replication due
        # to user request", "... and terminating connection ..."). The cancel's SQLSTATE
        # is 01000, that of any plain WARNING (a filling NOTIFY queue's too), so only the
        # text tells it apart: it is English unless the server's lc_messages says otherwise
        # (the health report shows lc_messages).
        message = diag.message_primary or ""
        if diag.severity_nonlocalized == "WARNING" and "synchronous replication" in message:
            self.seen = message


def watch_of(info: dict[Any, Any]) -> Watch | None:
    """The connection's watch, or None: payorch has not used this connection yet."""
    found: Watch | None = info.get(_KEY)
    return found


def adopt(info: dict[Any, Any], dbapi_connection: Any, row: Any) -> Watch:
    """After :data:`ROLE_SQL` answered ``row`` on a connection: refuse a standby or a
    read-only session (:class:`DatabaseReadOnly`), else install its watch."""
    in_recovery, read_only = row[0], row[1]
    driver = getattr(dbapi_connection, "_connection", dbapi_connection)  # the async adapter
    where = _where(driver)
    if in_recovery:
        raise DatabaseReadOnly(
            f"the database at {where} is a standby (in recovery): payorch writes to the "
            f"primary only; {_TARGET}"
        )
    if read_only == "on":
        raise DatabaseReadOnly(
            f"the session at {where} is read-only (default_transaction_read_only=on): "
            "payorch needs a read-write session on the primary"
        )
    watch = Watch()
    driver.add_notice_handler(watch)
    info[_KEY] = watch
    return watch


def first_use(
    fairy: Any, error: type[Exception], fetch_one: Callable[[str], list[Any]]
) -> Watch | None:
    """A connection payorch has not used yet (in autocommit): it must be a read-write
    primary (else ``DatabaseReadOnly``, the connection discarded); its watch, or None if
    it broke (discarded: nothing of ours was sent). ``fetch_one`` runs a statement on it
    (sync or awaited) and returns its first row in a list."""
    try:
        row = fetch_one(ROLE_SQL)[0]
    except error as orig:
        fairy.invalidate(orig)
        return None
    _note_citus(getattr(fairy, "_pool", None), row)
    try:
        return adopt(fairy.info, fairy.dbapi_connection, row)
    except StorageError:
        fairy.invalidate()
        raise


def _note_citus(pool: Any, row: Any) -> None:
    if pool is not None and row is not None and len(row) > 2:
        _CITUS[pool] = bool(row[2])


def citus_seen(engine: Engine) -> bool | None:
    """Whether ``engine``'s connections reached a database with Citus; None before its
    first connection was used (no statement is spent on knowing it)."""
    return _CITUS.get(engine.pool)


def session(conn: Connection) -> Watch | None:
    """The same for a SQLAlchemy connection (PostgreSQL; None on SQLite), its watch reset
    for the statements to come."""
    if conn.dialect.name != "postgresql":
        return None
    info = conn.connection.info
    watch = watch_of(info)
    if watch is None:
        row = conn.exec_driver_sql(ROLE_SQL).first()
        _note_citus(conn.engine.pool, row)
        try:
            watch = adopt(info, conn.connection.dbapi_connection, row)
        except StorageError:
            conn.invalidate()
            raise
    watch.seen = None
    return watch


def after_commit(watch: Watch | None) -> None:
    """A write committed: uncertain after all if its wait for a synchronous standby was
    cancelled (the commit then exists on the primary alone)."""
    if watch is not None and watch.seen is not None:
        raise wait_cancelled(watch.seen)


def _where(driver: Any) -> str:
    info = getattr(driver, "info", None)
    if info is None:  # pragma: no cover - not psycopg
        return "the configured URL"
    host = info.host if info.host.startswith("/") else f"{info.host}:{info.port}"
    return f"{host}/{info.dbname}"


def read_only_error(orig: BaseException) -> DatabaseReadOnly:
    """SQLSTATE 25006 (read_only_sql_transaction): a write reached a standby or a read-only
    session after all (e.g. a server demoted under a pooled connection)."""
    first = str(orig).strip().splitlines()[0] if str(orig).strip() else "read-only transaction"
    return DatabaseReadOnly(
        f"the database refused a write ({first}): it is a standby or a read-only session; "
        f"payorch writes to the primary only; {_TARGET}"
    )


def wait_cancelled(warning: str) -> CommitUncertain:
    return CommitUncertain(
        f"the commit's wait for a synchronous standby was cancelled (server: {warning!r}): "
        "it exists on the primary only and a failover may lose it; retry with the same key "
        "later"
    )


def refuse_autocommit(engine: Engine) -> None:
    """Refuse an engine whose transactions would not be atomic: ``isolation_level=
    "AUTOCOMMIT"`` set on it (SQLAlchemy's own rule: the engine's execution option, else
    the level its connections are given when they connect)."""
    level = engine.get_execution_options().get("isolation_level")
    if level is None:
        # SQLAlchemy keeps create_engine(isolation_level=...) here; no public accessor.
        level = getattr(engine.dialect, "_on_connect_isolation_level", None)
    if level == "AUTOCOMMIT":
        raise ConfigurationError(
            "the engine runs in autocommit (isolation_level='AUTOCOMMIT'): payorch's "
            "multi-statement transactions would not be atomic on it; give payorch an engine "
            "without it (payorch.db.create_engine, or "
            "engine.execution_options(isolation_level='READ COMMITTED'))"
        )


def conninfo(engine: Engine, url: URL | None = None) -> str:
    """``url`` (default: the engine's) as a libpq connection string, for a connection
    payorch opens outside the pool (the waiters' LISTEN): multi-host lists and
    ``target_session_attrs`` as the engine's dialect reads them from ``?host=a:1&host=b:2``,
    so it reaches the same primary."""
    from psycopg.conninfo import make_conninfo

    args, params = engine.dialect.create_connect_args(url if url is not None else engine.url)
    text = {k: str(v) for k, v in params.items() if isinstance(v, str | int)}
    return make_conninfo(str(args[0]) if args else "", **text)
