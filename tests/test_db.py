"""Transactions retried by SQLSTATE, and database errors mapped once."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from payorch.errors import DatabaseUnavailable, InvalidRequest, StorageError
from payorch.storage._driver_sql import run_sql
from payorch.storage._engine import create_engine, run_in_transaction
from payorch.storage._pooling import normalise_url
from payorch.storage._store import Store


class _DriverError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
def test_serialization_failures_and_deadlocks_are_retried(store: Store, sqlstate: str) -> None:
    calls: list[int] = []

    def txn(conn: Connection) -> int:
        calls.append(1)
        conn.execute(sa.text("SELECT 1"))
        if len(calls) < 3:
            raise sa.exc.OperationalError("UPDATE ...", {}, _DriverError(sqlstate))
        return len(calls)

    assert run_in_transaction(store.engine, txn) == 3


def test_other_errors_are_mapped_not_retried(store: Store) -> None:
    calls: list[int] = []

    def txn(conn: Connection) -> None:
        calls.append(1)
        raise sa.exc.IntegrityError("INSERT ...", {}, _DriverError("23505"))

    with pytest.raises(StorageError):
        run_in_transaction(store.engine, txn)
    assert len(calls) == 1


def test_sqlite_busy_is_retried(tmp_path: object) -> None:
    engine = create_engine(f"sqlite:///{tmp_path}/busy.db")
    calls: list[int] = []

    def txn(conn: Connection) -> str:
        calls.append(1)
        if len(calls) == 1:
            err = sqlite3.OperationalError("database is locked")
            err.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]
            raise sa.exc.OperationalError("BEGIN", {}, err)
        return "ok"

    try:
        assert run_in_transaction(engine, txn) == "ok"
        assert len(calls) == 2
    finally:
        engine.dispose()


def test_unreachable_database_is_database_unavailable() -> None:
    store = Store.from_url("postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2")
    try:
        with pytest.raises(DatabaseUnavailable):
            run_in_transaction(store.engine, lambda conn: conn.execute(sa.text("SELECT 1")))
    finally:
        store.close()


@pytest.mark.parametrize("url", ["mysql://x/y", "sqlite://", "sqlite:///:memory:", "not a url"])
def test_unsupported_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequest):
        normalise_url(url)


@pytest.mark.parametrize("built_by", ["payorch", "caller"])
def test_a_transaction_after_a_hot_statement_is_still_one_transaction(
    postgres_url: str, built_by: str
) -> None:
    """run_sql leaves its pooled connection in autocommit on payorch's engines; the next
    SQLAlchemy transaction on that very connection must still be all or nothing, on an
    engine the caller built (and handed to ``Store``) too."""
    make = create_engine if built_by == "payorch" else sa.create_engine
    engine = make(normalise_url(postgres_url), pool_size=1, max_overflow=0)
    try:
        assert run_sql(engine, "SELECT 1", {}, write=False) == (1,)
        with engine.connect() as conn:
            # A session's own table: the pool has one connection, so every statement sees it.
            conn.exec_driver_sql("CREATE TEMP TABLE hot_scratch (n integer)")
            conn.commit()

        def txn(conn: Connection) -> None:
            conn.exec_driver_sql("INSERT INTO hot_scratch VALUES (1)")
            raise sa.exc.IntegrityError("INSERT ...", {}, _DriverError("23505"))

        assert run_sql(engine, "SELECT 2", {}, write=False) == (2,)
        with pytest.raises(StorageError):
            run_in_transaction(engine, txn)
        assert run_sql(engine, "SELECT count(*) FROM hot_scratch", {}, write=False) == (0,)
        with engine.connect() as conn:  # and the connection reads with a transaction again
            assert conn.exec_driver_sql("SELECT count(*) FROM hot_scratch").scalar() == 0
            assert conn.in_transaction()
            assert conn.connection.driver_connection.autocommit is False
    finally:
        engine.dispose()
