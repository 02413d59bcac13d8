"""Replicated PostgreSQL: failover with lost commits, cancelled synchronous waits, standbys.

Each test starts its own primary and streaming standby on loopback (:mod:`pgreplica`),
migrated before the base backup so the standby has the schema. Effects are counted at the
provider: the sandbox's ledger.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from conftest import FAST_TIMEOUT, LoopThread, _pg_unavailable
from pgcluster import ClusterUnavailable
from pgreplica import ReplicaPair, poll

from payorch import migrate
from payorch.core import State
from payorch.errors import (
    CommitUncertain,
    ConfigurationError,
    DatabaseReadOnly,
    SyncStandbyUnavailable,
)
from payorch.execution._executor import Executor
from payorch.http import http_answer
from payorch.observing import _metrics as metrics
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._daemon import ReconcilerDaemon
from payorch.reconciling._reconciler import Reconciler
from payorch.storage._async_store import AsyncStore
from payorch.storage._driver_sql import run_sql
from payorch.storage._engine import create_async_engine, create_engine
from payorch.storage._store import Store

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

KEYS = [f"order-{i}" for i in range(8)]
PAYORCH = Path(sys.executable).with_name("payorch")


def strict_store(url: str) -> Store:
    """A store that claims only while a synchronous standby streams."""
    return Store(create_engine(url), require_sync_standby=True)


def payment(i: int) -> dict[str, object]:
    return {"amount": 1000 + i, "currency": "EUR", "customer": f"cus_{i}"}


def start(pair: ReplicaPair) -> None:
    try:
        pair.start_primary()
        migrate.upgrade(pair.primary_url)  # before the base backup: the standby has it too
        pair.start_standby()
    except BaseException as exc:
        pair.stop()  # no server outlives a failed start
        if isinstance(exc, ClusterUnavailable):
            _pg_unavailable(str(exc))
        raise


@pytest.fixture
def async_pair() -> Iterator[ReplicaPair]:
    pair = ReplicaPair(synchronous=False)
    start(pair)
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture
def provider(sandbox: SandboxServer) -> Iterator[SandboxProvider]:
    with SandboxProvider(
        base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
    ) as p:
        yield p


def executor_on(store: Store, provider: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
    )


def count_operations(url: str) -> int:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT count(*) FROM payorch_operations").scalar_one())
    finally:
        engine.dispose()


def effects_by_amount(sandbox: SandboxServer) -> Counter[int]:
    return Counter(int(e["amount"]) for e in sandbox.ledger())


def test_async_failover_loses_the_newest_claims_and_each_retry_makes_no_second_effect(
    async_pair: ReplicaPair, sandbox: SandboxServer, provider: SandboxProvider
) -> None:
    pair = async_pair
    url = pair.multi_host_url()  # the standby is listed first: libpq skips it (read-only)
    pair.stop_standby()  # the stream is cut: what the primary commits now stays there
    store = Store.from_url(url)
    try:
        ex = executor_on(store, provider)
        for i, key in enumerate(KEYS):
            done = ex.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key=key,
                request=payment(i),
            )
            assert done.state is State.SUCCEEDED
    finally:
        store.close()
    assert effects_by_amount(sandbox) == Counter(1000 + i for i in range(len(KEYS)))

    pair.kill_primary()  # claimed and charged, but never replicated
    pair.restart_standby()
    pair.promote()
    assert count_operations(pair.standby_url) == 0  # the claims are gone with the primary

    store = Store.from_url(url)  # the same URL: now only the promoted standby answers
    try:
        ex = executor_on(store, provider)
        for i, key in enumerate(KEYS):
            again = ex.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key=key,
                request=payment(i),
            )
            assert again.state is State.SUCCEEDED
    finally:
        store.close()
    # The retry sends the identical request under the identical downstream key: the
    # provider's idempotency answers it, no second charge.
    assert effects_by_amount(sandbox) == Counter(1000 + i for i in range(len(KEYS)))
    assert count_operations(pair.standby_url) == len(KEYS)


# -- a commit whose wait for the synchronous standby was cancelled ------------------------


def waiting_in_syncrep(pair: ReplicaPair) -> int | None:
    sql = "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep' LIMIT 1"
    pid = pair.scalar(pair.primary_port, sql)
    return int(pid) if isinstance(pid, int) else None


def test_a_cancelled_synchronous_wait_is_uncertain_and_no_provider_call_follows(
    sandbox: SandboxServer, provider: SandboxProvider
) -> None:
    pair = ReplicaPair(synchronous=True)
    start(pair)
    try:
        pair.stop_standby()  # commits now wait for it, in SyncRep
        store = Store.from_url(pair.primary_url)
        ex = executor_on(store, provider)
        raised: list[BaseException] = []

        def execute() -> None:
            try:
                ex.execute(
                    tenant_id="shop",
                    operation="payment.create",
                    idempotency_key="k",
                    request=payment(0),
                )
            except BaseException as exc:
                raised.append(exc)

        caller = threading.Thread(target=execute, daemon=True)
        caller.start()
        poll(
            "the claim's commit to wait for the standby",
            lambda: waiting_in_syncrep(pair) is not None,
        )
        # What an operator, a statement time-out or a pooler's cancel does: PostgreSQL then
        # answers the COMMIT with success and a WARNING; the row is on the primary alone.
        pair.scalar(pair.primary_port, f"SELECT pg_cancel_backend({waiting_in_syncrep(pair)})")
        caller.join(60)
        assert not caller.is_alive()
        try:
            [err] = raised
            assert isinstance(err, CommitUncertain), repr(err)
            assert "retry with the same key" in err.message
            # Recognised by the server's warning, not by a broken connection.
            assert "canceling wait for synchronous replication" in str(err.__cause__)
            answer = http_answer(err)
            assert answer.status == 503 and answer.body["retry"] == "same_key"
            assert sandbox.ledger() == []  # no provider call followed the uncertain commit
            assert count_operations(pair.primary_url) == 1  # committed locally only
        finally:
            store.close()

        # The primary dies before the standby got the claim: the retry on the promoted
        # standby is the first and only request the provider sees.
        pair.kill_primary()
        pair.restart_standby()
        pair.promote()
        assert count_operations(pair.standby_url) == 0
        store = Store.from_url(pair.multi_host_url())
        try:
            again = executor_on(store, provider).execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key="k",
                request=payment(0),
            )
        finally:
            store.close()
        assert again.state is State.SUCCEEDED
        assert effects_by_amount(sandbox) == Counter({1000: 1})
    finally:
        pair.stop()


# -- one synchronous pair for the reports, the standby URL and the strict setting --------


@pytest.fixture(scope="module")
def sync_pair() -> Iterator[ReplicaPair]:
    pair = ReplicaPair(synchronous=True)
    start(pair)
    try:
        yield pair
    finally:
        pair.stop()


def payorch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    return subprocess.run(
        [str(PAYORCH), *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        timeout=60,
        check=False,
    )


def health(url: str, **env: str) -> dict[str, object]:
    done = payorch("db", "health", "--json", "--database-url", url, env=env)
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


@contextlib.contextmanager
def monitored(store: Store) -> Iterator[httpx.Client]:
    """A reconciler daemon on ``store`` with its monitor on a free loopback port."""
    daemon = ReconcilerDaemon(Reconciler(store=store, providers=[]), monitor=("127.0.0.1", 0))
    daemon.start()
    try:
        assert daemon.monitor is not None
        with httpx.Client(base_url=daemon.monitor.url, timeout=10) as client:
            yield client
    finally:
        daemon.stop()


def start_up_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == "database.replication"]


def test_sync_replication_is_reported_by_health_readyz_metrics_and_at_start_up(
    sync_pair: ReplicaPair, caplog: pytest.LogCaptureFixture
) -> None:
    report = health(sync_pair.primary_url)
    assert report["mode"] == "sync" and report["synchronous"] is True
    assert report["synchronous_commit"] == "on"
    assert (report["required_sync_standbys"], report["sync_standbys_streaming"]) == (1, 1)
    store = Store.from_url(sync_pair.primary_url)
    try:
        with caplog.at_level(logging.INFO, logger="payorch.db"), monitored(store) as client:
            ready = client.get("/readyz")
            assert ready.status_code == 200 and "replication sync:" in ready.text, ready.text
            if metrics.AVAILABLE:
                scraped = client.get("/metrics").text
                assert 'payorch_database_replication_mode{mode="sync"} 1.0' in scraped
                assert "payorch_database_sync_standbys 1.0" in scraped
        [line] = start_up_lines(caplog)
        assert line.levelno == logging.INFO and "mode=sync" in line.getMessage()
    finally:
        store.close()


def test_async_replication_is_reported_with_a_warning(
    async_pair: ReplicaPair, caplog: pytest.LogCaptureFixture
) -> None:
    report = health(async_pair.primary_url)
    assert report["mode"] == "async" and report["synchronous"] is False
    assert (report["standbys_streaming"], report["sync_standbys_streaming"]) == (1, 0)
    store = Store.from_url(async_pair.primary_url)
    try:
        with caplog.at_level(logging.INFO, logger="payorch.db"), monitored(store) as client:
            ready = client.get("/readyz")  # ready: async is a choice, reported, not a fault
            assert ready.status_code == 200 and "replication async:" in ready.text, ready.text
        [line] = start_up_lines(caplog)
        assert line.levelno == logging.WARNING and "mode=async" in line.getMessage()
    finally:
        store.close()
    with pytest.raises(ConfigurationError, match="synchronous_standby_names is empty"):
        strict_store(async_pair.primary_url)


def test_a_standby_url_is_a_one_line_error_and_a_multi_host_url_finds_the_primary(
    sync_pair: ReplicaPair, sandbox: SandboxServer, provider: SandboxProvider
) -> None:
    store = Store.from_url(sync_pair.standby_url)
    try:
        with pytest.raises(DatabaseReadOnly, match="is a standby") as caught:
            executor_on(store, provider).execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key="s",
                request=payment(1),
            )
        assert "\n" not in caught.value.message and "target_session_attrs" in caught.value.message
    finally:
        store.close()
    assert sandbox.ledger() == []
    done = payorch("db", "health", "--database-url", sync_pair.standby_url)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and "is a standby" in done.stderr

    # Both hosts listed, the standby first: the pool and the waiters' LISTEN reach the primary.
    store = Store.from_url(sync_pair.multi_host_url())
    try:
        row = run_sql(store.engine, "SELECT inet_server_port()", {}, write=False)
        assert row is not None and row[0] == sync_pair.primary_port
        listener = store.listener()
        assert listener is not None and listener.start(timeout=30)
    finally:
        store.close()


def test_strict_claims_need_a_streaming_synchronous_standby(
    sync_pair: ReplicaPair,
    sandbox: SandboxServer,
    provider: SandboxProvider,
    loop_thread: LoopThread,
) -> None:
    strict = {"PAYORCH_REQUIRE_SYNC_STANDBY": "1"}
    assert health(sync_pair.primary_url, **strict)["problem"] is None
    store = strict_store(sync_pair.primary_url)  # starts: sync
    astore = AsyncStore(create_async_engine(sync_pair.primary_url), require_sync_standby=True)
    try:
        assert loop_thread.run(astore.check_replication()).mode == "sync"
        ex = executor_on(store, provider)
        first = ex.execute(
            tenant_id="shop", operation="payment.create", idempotency_key="a", request=payment(2)
        )
        assert first.state is State.SUCCEEDED
        with monitored(store) as client:
            assert client.get("/readyz").status_code == 200
            sync_pair.stop_standby()  # returns once the primary sees no standby
            try:
                with pytest.raises(SyncStandbyUnavailable, match="retry with the same key"):
                    ex.execute(
                        tenant_id="shop",
                        operation="payment.create",
                        idempotency_key="b",
                        request=payment(3),
                    )
                assert count_key(sync_pair.primary_url, "b") == 0  # nothing claimed
                assert effects_by_amount(sandbox) == Counter({1002: 1})
                ready = client.get("/readyz")
                assert ready.status_code == 503
                assert "PAYORCH_REQUIRE_SYNC_STANDBY is set and 0 of 1" in ready.text
                done = payorch("db", "health", "--database-url", sync_pair.primary_url, env=strict)
                assert done.returncode == 1 and "0 of 1 synchronous standbys" in done.stderr
                with pytest.raises(ConfigurationError, match="0 of 1 synchronous standbys"):
                    strict_store(sync_pair.primary_url)
                with pytest.raises(ConfigurationError, match="0 of 1 synchronous standbys"):
                    loop_thread.run(astore.check_replication())  # the async API's start-up
            finally:
                sync_pair.restart_standby()
                sync_pair.wait_streaming()
        again = ex.execute(
            tenant_id="shop", operation="payment.create", idempotency_key="b", request=payment(3)
        )
        assert again.state is State.SUCCEEDED
    finally:
        store.close()
        loop_thread.run(astore.close())
    assert effects_by_amount(sandbox) == Counter({1002: 1, 1003: 1})


def count_key(url: str, key: str) -> int:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            sql = "SELECT count(*) FROM payorch_operations WHERE idempotency_key = %(k)s"
            return int(conn.exec_driver_sql(sql, {"k": key}).scalar_one())
    finally:
        engine.dispose()
