"""Shared fixtures: real PostgreSQL and SQLite stores, migrated by Alembic.

PostgreSQL comes from ``PAYORCH_TEST_DATABASE_URL`` or a throwaway cluster started here.
Without one the PostgreSQL tests skip loudly; with ``PAYORCH_REQUIRE_POSTGRES=1`` they fail.
PgBouncer and redis-server (tests/pgbouncer.py, tests/redis_server.py) skip loudly when their
binaries are missing, whatever ``PAYORCH_REQUIRE_POSTGRES`` says: one summary line per
missing server ends the run.

Under pytest-xdist (``make test``) each worker is a session of its own: its own cluster on
its own port and data directory, its own databases, PgBouncer and redis-server.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import uuid
from collections.abc import Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import sqlalchemy as sa
from citus import SKIP_PREFIX as CITUS_SKIP
from citus import CitusUnavailable, coordinator_url, exclusive, missing_reason
from hypothesis import HealthCheck, settings
from pgcluster import Cluster, ClusterUnavailable

from payorch import migrate
from payorch.execution._async import AsyncExecutor
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._async_store import AsyncStore
from payorch.storage._store import Store
from payorch.storage._tables import (
    effects,
    events,
    operations,
    outbox,
    recon_files,
    recon_providers,
    recon_rows,
    route_keys,
    webhook_inbox,
)

# Fixtures shared by one family of test modules, kept beside that family's helpers.
pytest_plugins = ["stripe_helpers", "unexplained_helpers", "stripe_emulator", "adyen_emulator"]

# Hypothesis draws the same examples on every run, everywhere (not only in CI): seeded from
# each test (derandomize), no example database carried from run to run, no per-example
# deadline and no too-slow health check, so neither luck nor a loaded machine decides a
# result, and a failure seen in CI replays as it is on a laptop. To hunt for new examples,
# draw at random: `pytest --hypothesis-profile=explore` (timing still never fails a test).
_NO_TIMING = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("deterministic", derandomize=True, database=None, **_NO_TIMING)
settings.register_profile("explore", **_NO_TIMING)
settings.load_profile("deterministic")

_PG_PROBLEM: list[str] = []
REQUIRE_PG = os.environ.get("PAYORCH_REQUIRE_POSTGRES") == "1"


def _pg_unavailable(reason: str) -> None:
    _PG_PROBLEM.append(reason)
    if REQUIRE_PG:
        pytest.fail(f"PostgreSQL required (PAYORCH_REQUIRE_POSTGRES=1) but unavailable: {reason}")
    pytest.skip(f"PostgreSQL unavailable: {reason}")


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    if _PG_PROBLEM:
        _pg_unavailable(_PG_PROBLEM[0])
    env_url = os.environ.get("PAYORCH_TEST_DATABASE_URL")
    if env_url:
        yield env_url
        return
    try:
        cluster = Cluster()
        url = cluster.start()
    except ClusterUnavailable as exc:
        _pg_unavailable(str(exc))
        return
    try:
        yield url
    finally:
        cluster.stop()


def create_pg_database(server_url: str, prefix: str = "payorch_test") -> str:
    """A fresh database on the server; returns its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except sa.exc.OperationalError as exc:
        _pg_unavailable(f"cannot reach {admin.url!r}: {exc.orig}")
    finally:
        admin.dispose()
    return sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_url(pg_server_url: str) -> str:
    url = create_pg_database(pg_server_url)
    migrate.upgrade(url)
    return url


_CITUS_PROBLEM: list[str] = []


@pytest.fixture(scope="session")
def citus_url() -> Iterator[str]:
    """A Citus coordinator (two workers) with payorch's schema distributed by tenant: from
    ``PAYORCH_TEST_CITUS_URL`` or started here when the extension is installed; otherwise
    a skip (CI runs without Citus: the distribution does not package it)."""
    if _CITUS_PROBLEM:
        pytest.skip(f"{CITUS_SKIP}: {_CITUS_PROBLEM[0]}")
    try:
        url, cluster = coordinator_url()
    except CitusUnavailable as exc:
        _CITUS_PROBLEM.append(str(exc))
        pytest.skip(f"{CITUS_SKIP}: {exc}")
    try:
        with exclusive(url):
            migrate.upgrade(url)
            migrate.distribute(url)
        yield url
    finally:
        if cluster is not None:
            cluster.stop()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


_EMPTIED = "; ".join(
    f"DELETE FROM {t.name}"
    for t in (
        operations,
        events,
        webhook_inbox,
        outbox,
        effects,
        recon_files,
        recon_rows,
        recon_providers,
        route_keys,
    )
)


def _truncate(url: str) -> None:
    """Empty the session database's tables for the next test. DELETE, not TRUNCATE: the
    tables hold a test's few rows and no foreign key, trigger or sequence, and a TRUNCATE
    makes and drops files for every table and index (~60 ms a test, ~8 for this); one plain
    connection, not an engine (no dialect start-up queries)."""
    import psycopg

    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_EMPTIED)


@pytest.fixture(params=["sqlite", "postgres", "citus"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        target = tmp_path / "payorch.db"
        shutil.copyfile(template, target)
        yield f"sqlite:///{target}"
        return
    url: str = request.getfixturevalue("citus_url" if request.param == "citus" else "pg_url")
    with exclusive(url):
        _truncate(url)
        yield url


@pytest.fixture
def postgres_url(request: pytest.FixtureRequest) -> str:
    """PostgreSQL only (multi-process races, SKIP LOCKED)."""
    url: str = request.getfixturevalue("pg_url")
    _truncate(url)
    return url


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store.from_url(db_url)
    try:
        yield s
    finally:
        s.close()


# The servers the tests start their own of: a skip's reason begins with the first words
# (pgcluster, tests/pgbouncer.py's and tests/redis_server.py's SKIP_PREFIX), then how to get
# it. The summary reads the reports, not this process's state: under pytest-xdist the skips
# happen in the workers and only their reports reach the process that writes the summary.
_SERVERS = {
    "POSTGRESQL": (
        "PostgreSQL unavailable",
        "install the Debian package postgresql (`make test` as root does) or set "
        "PAYORCH_TEST_DATABASE_URL",
    ),
    "PGBOUNCER": (
        "PgBouncer unavailable",
        "install the Debian package pgbouncer (`make test` as root does)",
    ),
    "CITUS": (
        CITUS_SKIP,
        "install the Citus extension for the server's PostgreSQL (the distribution does not "
        "package it) or set PAYORCH_TEST_CITUS_URL to a coordinator",
    ),
    "REDIS-SERVER": (
        "redis-server unavailable",
        "install the Debian package redis-server (`make test` as root does)",
    ),
}


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> Iterator[None]:
    """After the run's last line (the counts): one line per server whose tests did not run."""
    yield
    terminalreporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminalreporter is not None and not hasattr(session.config, "workerinput"):
        _missing_servers(terminalreporter)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without Citus, its tests are left out at collection (hundreds of parametrised cases,
    not a skip line each); the run ends with one line saying so (:func:`_missing_servers`)."""
    if missing_reason() is None:
        return
    keep, left_out = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_citus = callspec is not None and callspec.params.get("db_url") == "citus"
        (left_out if on_citus or "citus_url" in getattr(item, "fixturenames", ()) else keep).append(
            item
        )
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = keep


def _missing_servers(terminalreporter: pytest.TerminalReporter) -> None:
    citus = missing_reason()
    if citus is not None:
        prefix, remedy = _SERVERS["CITUS"]
        line = f"CITUS TESTS DID NOT RUN (left out): {citus}; {remedy}"
        terminalreporter.write_sep("!", line, red=True, bold=True)
    skipped = [_reason(r) for r in terminalreporter.stats.get("skipped", [])]
    for server, (prefix, remedy) in _SERVERS.items():
        reasons = [r for r in skipped if r.startswith(prefix)]
        if reasons:
            why = reasons[0].removeprefix(prefix).removeprefix(": ").splitlines()[0]
            line = f"{server} TESTS DID NOT RUN ({len(reasons)} skipped): {why}; {remedy}"
            terminalreporter.write_sep("!", line, red=True, bold=True)
    failed = terminalreporter.stats.get("error", []) + terminalreporter.stats.get("failed", [])
    if REQUIRE_PG and any("PostgreSQL required" in _reason(r) for r in failed):
        terminalreporter.write_sep(
            "!", "POSTGRESQL TESTS FAILED: PostgreSQL unavailable (see the errors)", red=True
        )


# -- the sandbox acquirer on loopback ----------------------------------------------------

# A loaded CI machine can take well over half a second to answer on loopback: a read
# time-out shorter than that turns a plain answer into a false "no answer".
FAST_TIMEOUT = httpx.Timeout(connect=1.0, read=2.0, write=1.0, pool=1.0)
# A dropped response holds its socket well past the client's read time-out.
DROP_HOLD_SECONDS = 6.0


@pytest.fixture
def sandbox() -> Iterator[SandboxServer]:
    # drop_hold: a dropped response holds the socket a little longer than the client waits.
    with SandboxServer(drop_hold_seconds=DROP_HOLD_SECONDS) as sb:
        yield sb


@pytest.fixture
def acquirers() -> Iterator[tuple[SandboxServer, SandboxServer]]:
    """Two sandbox acquirers (the routing tests'); the adapters the test opened with
    ``routing_helpers.adapters`` are closed after it."""
    import routing_helpers

    try:
        with (
            SandboxServer(drop_hold_seconds=DROP_HOLD_SECONDS) as a,
            SandboxServer(drop_hold_seconds=DROP_HOLD_SECONDS, seed=1) as b,
        ):
            yield a, b
    finally:
        routing_helpers.close_opened()


def effects_of(
    sandbox: SandboxServer, store: Store, tenant_id: str, operation_id: str
) -> list[dict[str, Any]]:
    """The sandbox effects one stored operation made: those under its downstream key (what
    payorch sent, from the namespace; the operation id never crosses to the provider)."""
    return sandbox.effects_for(store.get(tenant_id, operation_id).downstream_key)


class Ledger:
    """What a served stack's sandbox holds, by tenant or by operation (its ``sandbox`` and
    ``engine``): the effects counted at the provider."""

    sandbox: SandboxServer
    engine: sa.Engine

    def effects(self, tenant: str) -> list[dict[str, Any]]:
        ledger = self.sandbox.ledger()
        return [e for e in ledger if e["metadata"].get("payorch_tenant_id") == tenant]

    def downstream_key(self, tenant: str, op_id: str) -> str:
        """The key payorch sent the provider for the operation (stored on its row)."""
        query = sa.select(operations.c.downstream_key).where(
            operations.c.tenant_id == tenant, operations.c.id == op_id
        )
        with self.engine.connect() as conn:
            return str(conn.execute(query).scalar_one())

    def effects_of(self, tenant: str, op_id: str) -> list[dict[str, Any]]:
        return self.sandbox.effects_for(self.downstream_key(tenant, op_id))


@pytest.fixture
def sandbox_provider(sandbox: SandboxServer) -> Iterator[SandboxProvider]:
    with SandboxProvider(
        base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
    ) as provider:
        yield provider


class RecordingSleep:
    """Stands in for time.sleep in retry loops: records the delays, waits for nothing."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


T = TypeVar("T")


class LoopThread:
    """One event loop on its own thread: sync tests hand it coroutines and wait for them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    try:
        yield loop
    finally:
        loop.close()


class AsyncDriven:
    """An :class:`AsyncExecutor` behind the sync ``execute()`` the executor tests call."""

    def __init__(self, executor: AsyncExecutor, loop: LoopThread, sleep: RecordingSleep) -> None:
        self.async_executor = executor
        self._loop = loop
        self._sleep = sleep  # what the tests inspect, as on Executor

    def execute(self, **kwargs: Any) -> Any:
        return self._loop.run(self.async_executor.execute(**kwargs))

    def __getattr__(self, name: str) -> Any:  # registry, lease, owner, providers, …
        return getattr(self.async_executor, name)


def recorded_async_sleep(sleep: RecordingSleep) -> Any:
    async def asleep(seconds: float) -> None:
        sleep(seconds)

    return asleep


@pytest.fixture(params=["sync", "async"])
def executor(
    request: pytest.FixtureRequest, db_url: str, store: Store, sandbox_provider: SandboxProvider
) -> Iterator[Executor]:
    """The executor under test, sync and async: the same tests hold for both."""
    sleep = RecordingSleep()
    settings: dict[str, Any] = {
        "registry": default_registry("sandbox"),
        "lease": timedelta(seconds=30),
        "owner": "test-executor",
    }
    if request.param == "sync":
        yield Executor(store=store, providers=[sandbox_provider], sleep=sleep, **settings)
        return
    loop: LoopThread = request.getfixturevalue("loop_thread")
    astore = AsyncStore.from_url(db_url)
    ex = AsyncExecutor(
        store=astore,
        providers=[sandbox_provider],
        sleep=recorded_async_sleep(sleep),
        **settings,
    )
    try:
        yield AsyncDriven(ex, loop, sleep)  # type: ignore[misc]  # Executor's execute() face
    finally:
        loop.run(sandbox_provider.aclose())
        loop.run(astore.close())


def make_due(store: Store, operation_id: str) -> None:
    """Let time pass for one operation: its lease and its next check lie in the past."""
    past = datetime.now(UTC) - timedelta(hours=1)
    t = operations.c
    with store.engine.begin() as conn:
        conn.execute(sa.update(operations).where(t.id == operation_id).values(next_check_at=past))
        conn.execute(
            sa.update(operations)
            .where(t.id == operation_id, t.lease_expires_at.is_not(None))
            .values(lease_expires_at=past)
        )


def age(store: Store, operation_id: str, by: timedelta) -> None:
    """Make an operation older (created earlier) by ``by``: the grace and window clocks."""
    with store.engine.begin() as conn:
        row = conn.execute(
            sa.select(operations.c.created_at).where(operations.c.id == operation_id)
        ).scalar_one()
        conn.execute(
            sa.update(operations).where(operations.c.id == operation_id).values(created_at=row - by)
        )
