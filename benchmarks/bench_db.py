"""Where the benchmark's databases come from, and what the server is configured to do.

PostgreSQL is ``$PAYORCH_BENCH_DATABASE_URL`` when set, otherwise a throwaway cluster started
with ``tests/pgcluster.py`` (the one the test suite uses). Each benchmark gets a fresh
database on that server, migrated by Alembic, and dropped again at the end.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from payorch import migrate
from payorch.storage._pooling import normalise_url

REPO = Path(__file__).resolve().parent.parent
ENV_URL = "PAYORCH_BENCH_DATABASE_URL"


@dataclass(frozen=True, kw_only=True)
class Server:
    url: str  # SQLAlchemy URL of the maintenance database
    origin: str  # where it came from, for the report


@dataclass(frozen=True, kw_only=True)
class Database:
    name: str
    url: str  # SQLAlchemy URL (postgresql+psycopg://...)
    conninfo: str  # the same for plain psycopg (postgresql://...)


def conninfo_of(url: str) -> str:
    """A libpq URI for plain psycopg from a SQLAlchemy URL."""
    return normalise_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def postgres_server(*, durable: bool = True, use_env: bool = True) -> Iterator[Server]:
    """The server to benchmark on; a throwaway cluster is stopped and deleted afterwards.

    ``durable``: the throwaway cluster keeps the server's default durability (the headline);
    otherwise it runs with ``fsync=off`` like the test suite's (the secondary row)."""
    env_url = os.environ.get(ENV_URL) if use_env else None
    if env_url:
        yield Server(
            url=normalise_url(env_url).render_as_string(hide_password=False), origin=ENV_URL
        )
        return
    sys.path.insert(0, str(REPO / "tests"))
    from pgcluster import Cluster  # the test suite's throwaway cluster

    cluster = Cluster(durable=durable)
    try:
        url = cluster.start()
        kind = "server-default durability" if durable else "fsync=off"
        yield Server(
            url=url, origin=f"throwaway cluster, {kind} (tests/pgcluster.py, {cluster.bindir})"
        )
    finally:
        cluster.stop()


@contextmanager
def fresh_database(server: Server, prefix: str) -> Iterator[Database]:
    """A new database on ``server``, migrated to head; dropped on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = conninfo_of(server.url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = make_url(server.url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(url)
        yield Database(name=name, url=url, conninfo=conninfo_of(url))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def analyze(conninfo: str) -> None:
    """``ANALYZE`` the database: what autovacuum does within its first minute of writes.

    A fresh database has no statistics, and the plans PostgreSQL caches for prepared
    statements (psycopg prepares a statement on its fifth run) are chosen then: with every
    index equally cheap on a table thought empty, a write by primary key may walk a
    tenant-wide index and slow down as the table grows, until an ANALYZE replans it. The
    benchmark analyzes after the warm-up, as autovacuum would have in production, so every
    arm runs on the plans a live database has."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("ANALYZE")


def server_settings(conninfo: str) -> dict[str, str]:
    """The settings that decide what a commit costs, as the server reports them."""
    names = (
        "fsync",
        "synchronous_commit",
        "full_page_writes",
        "wal_sync_method",
        "shared_buffers",
        "wal_level",
    )
    out: dict[str, str] = {}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        out["server_version"] = str(row[0]) if row else "?"
        for name in names:
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            out[name] = str(row[0]) if row else "?"
    return out
