"""Transactions retried by SQLSTATE, and database errors mapped once."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from payorch.db import create_engine, normalise_url, run_in_transaction
from payorch.errors import DatabaseUnavailable, InvalidRequest, StorageError
from payorch.store import Store


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
