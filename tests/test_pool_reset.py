"""A pooled PostgreSQL connection comes back clean: payorch's reset rolls back whatever is
open (a transaction, a failed one) and skips only the no-op of an idle connection, on the
sync and the async driver alike."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import Engine

from payorch.db import create_async_engine, create_engine
from payorch.storage._bridge import run_bridged
from payorch.storage._driver_sql import run_sql

IDLE, INTRANS, INERROR = 0, 2, 3  # libpq's PQTRANS_* values


def _driver(fairy: Any) -> Any:
    return getattr(fairy.dbapi_connection, "_connection", fairy.dbapi_connection)


def _left_open(engine: Engine, how: str) -> None:
    """Check a connection out, leave it ``how`` (an open write, a failed statement), return
    it; then the pool's next checkout must be idle and the write gone. The pool holds one
    connection, so the temporary table is the same session's throughout."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TEMP TABLE IF NOT EXISTS pool_reset (n int)")
    fairy = engine.raw_connection()
    fairy.dbapi_connection.autocommit = False  # type: ignore[union-attr]
    cursor = fairy.dbapi_connection.cursor()  # type: ignore[union-attr]
    cursor.execute("INSERT INTO pool_reset VALUES (1)")
    if how == "failed":
        with pytest.raises(psycopg.errors.DivisionByZero):
            cursor.execute("SELECT 1 / 0")
    assert _driver(fairy).info.transaction_status == (INERROR if how == "failed" else INTRANS)
    fairy.close()  # back to the pool, without commit

    again = engine.raw_connection()
    try:
        assert _driver(again).info.transaction_status == IDLE
    finally:
        again.close()
    row = run_sql(engine, "SELECT count(*) FROM pool_reset", {}, write=False)
    assert row is not None and row[0] == 0


@pytest.mark.parametrize("how", ["open", "failed"])
def test_sync_pool_rolls_back_what_is_open(postgres_url: str, how: str) -> None:
    engine = create_engine(postgres_url, pool_size=1, max_overflow=0)
    try:
        _left_open(engine, how)
    finally:
        engine.dispose()


@pytest.mark.parametrize("how", ["open", "failed"])
def test_async_pool_rolls_back_what_is_open(postgres_url: str, how: str) -> None:
    async def run() -> None:
        engine = create_async_engine(postgres_url, pool_size=1, max_overflow=0)
        try:
            await run_bridged(_left_open, engine.sync_engine, how)
        finally:
            await engine.dispose()

    asyncio.run(run())
