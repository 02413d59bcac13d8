"""Replicated PostgreSQL: failover with lost commits, cancelled synchronous waits, standbys.

Each test starts its own primary and streaming standby on loopback (:mod:`pgreplica`),
migrated before the base backup so the standby has the schema. Effects are counted at the
provider: the sandbox's ledger.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from conftest import FAST_TIMEOUT, _pg_unavailable
from pgcluster import ClusterUnavailable
from pgreplica import ReplicaPair

from payorch import migrate
from payorch.core import State
from payorch.executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.store import Store

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

KEYS = [f"order-{i}" for i in range(8)]


def payment(i: int) -> dict[str, object]:
    return {"amount": 1000 + i, "currency": "EUR", "customer": f"cus_{i}"}


def start(pair: ReplicaPair) -> None:
    try:
        pair.start_primary()
        migrate.upgrade(pair.primary_url)  # before the base backup: the standby has it too
        pair.start_standby()
    except ClusterUnavailable as exc:
        pair.stop()
        _pg_unavailable(str(exc))


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
                tenant_id="shop", operation="payment.create", idempotency_key=key, request=payment(i)
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
                tenant_id="shop", operation="payment.create", idempotency_key=key, request=payment(i)
            )
            assert again.state is State.SUCCEEDED
    finally:
        store.close()
    # The retry sends the identical request under the identical downstream key: the
    # provider's idempotency answers it, no second charge.
    assert effects_by_amount(sandbox) == Counter(1000 + i for i in range(len(KEYS)))
    assert count_operations(pair.standby_url) == len(KEYS)
