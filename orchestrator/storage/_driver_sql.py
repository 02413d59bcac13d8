"""SQL text run on the pooled psycopg connection itself: the hot statements.

The claim, the outcome write, a waiter's read and the reconciler's lease need neither
SQLAlchemy's ``Connection`` nor its result machinery, which cost more client CPU than the rest
of an operation. Each runs here in autocommit, one round trip, with the verdicts of
:mod:`payorch.storage._engine` on a failure (an unanswered write is ``CommitUncertain``); the
connection goes back to the pool still in autocommit on payorch's engines (the checkout
listener switches it back for anyone else).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from sqlalchemy import exc
from sqlalchemy.engine import Connection, Engine

from ..errors import DatabaseUnavailable, StorageError
from . import _sessions as sessions
from ._bridge import wait_for
from ._checkouts import RAW_CHECKOUT, runs_on_driver
from ._engine import MAX_TRANSACTION_ATTEMPTS, SCHEMAS, judge, map_db_error, run_statement

__all__ = ["run_sql", "run_sql_rows"]


def run_sql(
    engine: Engine, sql: str, params: Mapping[str, Any], *, write: bool = True
) -> tuple[Any, ...] | None:
    """``sql`` (psycopg's ``%(name)s`` style) as :func:`run_statement` runs it: autocommit,
    one round trip, the same verdicts; its first row as the driver hands it, or None.

    On psycopg engines, sync or async (the bridge), it runs on the pooled driver connection
    itself: the hot statements need neither SQLAlchemy's ``Connection`` nor its result
    metadata, which cost more client CPU than the rest of an operation (statement
    listeners do not see these statements; the round trips are the same). On an async
    engine each round trip is one await on the loop. Elsewhere (aiosqlite) it runs through
    ``exec_driver_sql``.
    """
    rows = _run_sql(engine, sql, params, write=write, every=False)
    return rows[0] if rows else None


def run_sql_rows(
    engine: Engine,
    sql: str,
    params: Mapping[str, Any],
    *,
    write: bool = True,
    replan: bool = False,
) -> list[tuple[Any, ...]]:
    """:func:`run_sql`, every row. ``replan``: never prepared, so planned on each run for the
    table as it is then (a scan whose best plan changes as the table grows, run seldom
    enough that its planning costs nothing; a cached generic plan would be chosen once,
    on a fresh table, and kept)."""
    return _run_sql(engine, sql, params, write=write, every=True, replan=replan)


def _run_sql(
    engine: Engine,
    sql: str,
    params: Mapping[str, Any],
    *,
    write: bool,
    every: bool,
    replan: bool = False,
) -> list[tuple[Any, ...]]:
    if not runs_on_driver(engine):
        return _run_sql_via_sqlalchemy(engine, sql, params, write=write, every=every)
    error: type[Exception] = engine.dialect.loaded_dbapi.Error
    fetch = _fetch_awaited if engine.dialect.is_async else _fetch
    # On payorch's engines the connection goes back still in autocommit: the next statement
    # run here needs no switch, and the checkout listener switches it back for anyone else.
    # An engine the caller built has no such listener: there it goes back at once to the
    # mode it had (an AUTOCOMMIT engine's stays in autocommit).
    ours = engine in SCHEMAS
    for attempt in range(MAX_TRANSACTION_ATTEMPTS):
        fairy = _checkout(engine, error)
        driver: Any = fairy.driver_connection  # psycopg's Connection or AsyncConnection
        was = driver.autocommit  # a caller's engine gets its connection back in this mode
        try:
            watch = None
            if was or _set_autocommit(fairy, True):
                cursor = _cursor_of(fairy, driver)
                watch = sessions.watch_of(fairy.info) or sessions.first_use(
                    fairy, error, functools.partial(fetch, cursor, params=None, every=False)
                )
            if watch is None:
                # Unusable before anything was sent: nothing to be uncertain about.
                if attempt == 0:
                    continue  # once, on a fresh connection
                raise DatabaseUnavailable("database connection lost before the statement")
            watch.seen = None
            try:
                rows = fetch(cursor, sql, params, every, False if replan else None)
            except error as orig:
                broken = bool(driver.closed or driver.broken)
                if broken:
                    fairy.invalidate(orig)
                judge(
                    _wrapped(sql, params, orig, error, broken=broken),
                    may_have_committed=write,
                    again_if_broken=not write and attempt == 0,
                    attempt=attempt,
                )
                continue
            if write and watch.seen is not None:
                raise sessions.wait_cancelled(watch.seen)
            return [row for row in rows if row is not None]
        finally:
            if not ours and fairy.is_valid and driver.autocommit != was:
                _set_autocommit(fairy, was)
            fairy.close()  # back to the pool (or, invalidated, discarded)
    raise StorageError("statement retries exhausted")  # pragma: no cover - loop returns/raises


_CURSOR = "payorch_cursor"  # in the pool's per-connection info (cleared on reconnect)


def _cursor_of(fairy: Any, driver: Any) -> Any:
    """The connection's cursor for run_sql, made once: a fresh cursor per statement would
    look up every column's loader again."""
    cursor = fairy.info.get(_CURSOR)
    if cursor is None or cursor.closed or cursor.connection is not driver:
        cursor = fairy.info[_CURSOR] = driver.cursor()
    return cursor


def _fetch(
    cursor: Any,
    sql: str,
    params: Mapping[str, Any] | None,
    every: bool,
    prepare: bool | None = None,
) -> list[Any]:
    cursor.execute(sql, params, prepare=prepare)
    return cursor.fetchall() if every else [cursor.fetchone()]


def _fetch_awaited(cursor: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`_fetch` (the same arguments) on a cursor of psycopg's AsyncConnection, from sync
    code under the bridge: the statement and its rows in one await."""
    return wait_for(_fetch_async(cursor, *args, **kwargs))


async def _fetch_async(
    cursor: Any,
    sql: str,
    params: Mapping[str, Any] | None,
    every: bool,
    prepare: bool | None = None,
) -> list[Any]:
    await cursor.execute(sql, params, prepare=prepare)
    return await cursor.fetchall() if every else [await cursor.fetchone()]


def _checkout(engine: Engine, error: type[Exception]) -> Any:
    """A pooled connection (the checkout listener drops a dead one), or the mapped error."""
    token = RAW_CHECKOUT.set(True)
    try:
        return engine.raw_connection()
    except error as orig:  # no connection could be opened
        failed = exc.DBAPIError.instance(None, None, orig, error, connection_invalidated=True)
        raise map_db_error(failed) from orig
    except exc.SQLAlchemyError as timeout:  # the pool's time-out
        raise map_db_error(timeout) from timeout
    finally:
        RAW_CHECKOUT.reset(token)


def _run_sql_via_sqlalchemy(
    engine: Engine, sql: str, params: Mapping[str, Any], *, write: bool, every: bool
) -> list[tuple[Any, ...]]:
    """:func:`run_sql` where the driver connection is not at hand (the async bridge)."""

    def run(conn: Connection) -> list[tuple[Any, ...]]:
        result = conn.exec_driver_sql(sql, params)
        found = result.all() if every else [result.first()]
        return [tuple(row) for row in found if row is not None]

    return run_statement(engine, run, write=write)


def _set_autocommit(fairy: Any, value: bool) -> bool:
    """Set the pooled connection's autocommit mode; False (and the connection invalidated,
    so the pool discards it) if the connection can no longer take it. Through the DBAPI
    face: for the async driver, SQLAlchemy's adapter awaits the switch."""
    try:
        fairy.dbapi_connection.autocommit = value
    except Exception as exc:  # noqa: BLE001 - psycopg.Error: closed or broken meanwhile
        fairy.invalidate(exc)
        return False
    return True


def _wrapped(
    sql: str, params: Mapping[str, Any], orig: Exception, error: type[Exception], *, broken: bool
) -> exc.DBAPIError:
    """A driver error as SQLAlchemy would have raised it, for the one mapping above."""
    wrapped = exc.DBAPIError.instance(sql, dict(params), orig, error, connection_invalidated=broken)
    assert isinstance(wrapped, exc.DBAPIError)
    return wrapped
