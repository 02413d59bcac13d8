"""A backlog drains: checks run concurrently, reconcilers share the work, none is doubled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from conftest import RecordingSleep, effects_of, make_due
from overlap import Overlap, OverlapProxy
from typer.testing import CliRunner

from payorch.cli._app import app
from payorch.errors import ConfigurationError
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.provider import Answer, StatusQuery
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcileReport, ReconcilerPolicy
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
MONEY = ("succeeded", "processing")
BACKLOG = 200
PAYORCH = Path(sys.executable).with_name("payorch")


def backlog(store: Store, sandbox: SandboxServer, provider: SandboxProvider, n: int) -> list[str]:
    """``n`` operations whose answer was lost after the provider charged: all due now."""
    ex = Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        sleep=RecordingSleep(),
    )
    sandbox.inject("error_500_after", times=n)
    ids = [
        ex.execute(
            tenant_id="shop", operation="payment.create", idempotency_key=f"d-{i}", request=PAYMENT
        ).operation_id
        for i in range(n)
    ]
    for op_id in ids:
        make_due(store, op_id)
    return ids


def hold(store: Store, ids: list[str]) -> None:
    """Not due for an hour."""
    later = datetime.now(UTC) + timedelta(hours=1)
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(operations).where(operations.c.id.in_(ids)).values(next_check_at=later)
        )


def started(proc: subprocess.Popen[str], timeout: float) -> bool:
    """Whether ``proc`` logged ``reconciler.started`` within ``timeout``. A thread reads its
    log lines to the end, so a full pipe never blocks it."""
    stream = proc.stderr
    assert stream is not None
    decided = threading.Event()  # it started, or its log ended (it exited)
    seen: list[str] = []

    def read() -> None:
        for line in stream:
            if '"reconciler.started"' in line:
                seen.append(line)
                decided.set()
        decided.set()

    threading.Thread(target=read, daemon=True).start()
    return decided.wait(timeout) and bool(seen)


class MeetingProvider(SandboxProvider):
    """The sandbox adapter of one reconciler: each status query arrives at ``overlap`` first."""

    def __init__(self, *, overlap: Overlap, party: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.overlap = overlap
        self.party = party

    def query_status(self, query: StatusQuery) -> Answer:
        self.overlap.arrive(self.party)
        return super().query_status(query)


@contextmanager
def slow_status(sandbox: SandboxServer, overlap: Overlap, party: str) -> Iterator[SandboxProvider]:
    """Every call to the sandbox waits 50-300 ms there (its ``latency`` fault) first."""
    timeout = httpx.Timeout(connect=2.0, read=3.0, write=2.0, pool=2.0)
    with httpx.Client(headers={"X-Sandbox-Fault": "latency"}, timeout=timeout) as client:
        yield MeetingProvider(
            overlap=overlap, party=party, base_url=sandbox.url, client=client, timeout=timeout
        )


def status_queries(store: Store, ids: list[str]) -> Counter[str]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(events.c.operation_id).where(
                events.c.kind == "status_query", events.c.operation_id.in_(ids)
            )
        )
        return Counter(op for (op,) in rows)


def states(store: Store, ids: list[str]) -> Counter[str]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(operations.c.state).where(operations.c.id.in_(ids)))
        return Counter(s for (s,) in rows)


def effects(sandbox: SandboxServer, store: Store, ids: list[str]) -> int:
    found = (effects_of(sandbox, store, "shop", i) for i in ids)
    return sum(len([e for e in listed if e["status"] in MONEY]) for listed in found)


def test_two_concurrent_reconcilers_drain_200_slow_checks_once_each(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    ids = backlog(store, sandbox, sandbox_provider, BACKLOG)
    start = threading.Barrier(2)
    # The first reconciler's checks wait until the second has one in flight too: while the
    # first holds its batch, the second must be able to lease the rest. No time-out of the
    # reconcilers runs meanwhile (the wait comes before the HTTP call), so this cannot fail
    # by chance: only if one reconciler's lease kept the other from working.
    overlap = Overlap(2, hold=60.0)
    reports: dict[str, ReconcileReport] = {}

    def work(owner: str) -> None:
        with slow_status(sandbox, overlap, owner) as provider:
            rec = Reconciler(
                store=store,
                providers=[provider],
                # A lease far longer than the run: none lapses while its check waits.
                policy=ReconcilerPolicy(lease=timedelta(minutes=10), batch_size=25, concurrency=8),
                owner=owner,
            )
            start.wait(timeout=60)
            reports[owner] = rec.run_until_idle(max_passes=100)

    threads = [threading.Thread(target=work, args=(f"drain-{w}",)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(reports) == {"drain-0", "drain-1"}
    assert overlap.met  # both held checks at the same time
    assert sum(r.outcomes["succeeded"] for r in reports.values()) == BACKLOG
    # No check lost to the other reconciler (a StaleVersion), none done twice.
    assert not any(r.outcomes["lost_race"] for r in reports.values())
    assert states(store, ids) == Counter({"succeeded": BACKLOG})
    queries = status_queries(store, ids)
    assert set(queries) == set(ids) and set(queries.values()) == {1}
    assert effects(sandbox, store, ids) == BACKLOG  # the ledger: one charge each, none added


def test_a_check_queued_past_its_lease_renews_it_or_yields_to_the_new_holder(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    first, second = backlog(store, sandbox, sandbox_provider, 2)
    rec_a = Reconciler(
        store=store,
        providers=[sandbox_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30)),
        owner="a",
    )
    rec_b = Reconciler(store=store, providers=[sandbox_provider], owner="b")
    picked = {
        r.id: (r, now)
        for r, now in store.claim_due(owner="a", lease=timedelta(seconds=30), limit=2)
    }
    long_ago = time.monotonic() - 3600  # as if it queued for an hour behind other checks
    # Still held by "a": renewed (version moves on) and checked.
    record, now = picked[first]
    assert rec_a._check_leased(record, now, long_ago) == "succeeded"
    # Lapsed and taken by "b" meanwhile: "a" does not touch it, "b" settles it.
    record, now = picked[second]
    make_due(store, second)
    assert [r.id for r, _ in store.claim_due(owner="b", lease=timedelta(seconds=30), limit=5)] == [
        second
    ]
    assert rec_a._check_leased(record, now, long_ago) == "lost_race"
    assert store.get("shop", second).lease_owner == "b"
    assert rec_b.run_until_idle().picked == 0  # "b" holds it under lease: not due
    make_due(store, second)
    assert rec_b.run_until_idle().outcomes == Counter({"succeeded": 1})
    assert status_queries(store, [first, second]) == Counter({first: 1, second: 1})
    assert effects(sandbox, store, [first, second]) == 2


@pytest.mark.parametrize("concurrency", [0, 11])
def test_concurrency_of_zero_or_above_the_pool_is_refused_at_start_up(
    store: Store, sandbox_provider: SandboxProvider, concurrency: int
) -> None:
    with pytest.raises(ConfigurationError, match="concurrency"):
        policy = ReconcilerPolicy(concurrency=concurrency)
        pool = store.engine.pool.size()  # type: ignore[attr-defined]
        assert concurrency > pool or concurrency == 0
        Reconciler(store=store, providers=[sandbox_provider], policy=policy)


def test_cli_refuses_a_bad_concurrency_in_one_line(db_url: str) -> None:
    result = CliRunner().invoke(
        app, ["reconcile", "once", "--concurrency", "0", "--database-url", db_url]
    )
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "concurrency" in result.stderr


def test_two_daemon_processes_drain_the_backlog_once_each(
    postgres_url: str, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    store = Store.from_url(postgres_url)
    procs: list[subprocess.Popen[str]] = []
    # Each daemon reaches the sandbox through a proxy of its own, which holds its requests
    # until the other daemon has one in flight too (for at most 2 s: less than the daemons'
    # read time-out). That makes both take a share on any machine that is not starved; the
    # test asserts on outcomes only, never on who did what.
    overlap = Overlap(2, hold=2.0)
    proxies = [OverlapProxy(sandbox.url, overlap, f"daemon-{d}") for d in range(2)]
    try:
        ids = backlog(store, sandbox, sandbox_provider, BACKLOG)
        hold(store, ids)  # not due until both daemons run
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
        env |= {"PAYORCH_RECONCILE_CONCURRENCY": "8"}
        argv = [str(PAYORCH), "--log-format", "json", "reconcile", "run", "--interval", "0.5"]
        argv += ["--batch", "25", "--metrics-addr", "off", "--database-url", postgres_url]
        for proxy in proxies:
            procs.append(
                subprocess.Popen(
                    argv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env | {"PAYORCH_SANDBOX_URL": proxy.http_url},
                )
            )
        for proc in procs:
            assert started(proc, timeout=60)
        for op_id in ids:
            make_due(store, op_id)
        deadline = time.monotonic() + 180
        while states(store, ids).get("succeeded", 0) < BACKLOG and time.monotonic() < deadline:
            time.sleep(0.2)  # bounded: the daemons report to the database, not to us
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0]
        assert all(out.startswith("stopped after") for out in outputs)
        assert states(store, ids) == Counter({"succeeded": BACKLOG})
        # Each checked once, by one of the two daemons; the ledger: one charge each.
        queries = status_queries(store, ids)
        assert set(queries) == set(ids) and set(queries.values()) == {1}
        with store.engine.connect() as conn:
            actors = {
                a
                for (a,) in conn.execute(
                    sa.select(events.c.actor).where(events.c.kind == "status_query")
                )
            }
        assert {a.rsplit(":", 1)[-1] for a in actors} <= {str(p.pid) for p in procs}
        assert effects(sandbox, store, ids) == BACKLOG
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        for proxy in proxies:
            proxy.close()
        store.close()
