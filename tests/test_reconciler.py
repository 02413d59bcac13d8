"""The reconciler drives unknown and abandoned operations to the truth, from evidence only."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
import workers
from conftest import FAST_TIMEOUT, RecordingSleep, age, effects_of, make_due
from overlap import Overlap, OverlapProxy

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._daemon import ReconcilerDaemon
from payorch.reconciling._reconciler import Reconciler, ReconcileReport, ReconcilerPolicy
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
MONEY = ("succeeded", "processing")


def effects(sandbox: SandboxServer, store: Store, op_id: str) -> int:
    return len([e for e in effects_of(sandbox, store, "shop", op_id) if e["status"] in MONEY])


def reconciler(store: Store, provider: SandboxProvider, **policy: Any) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30), **policy),
        owner="test-reconciler",
    )


def unknown_after(executor: Executor, sandbox: SandboxServer, fault: str, key: str = "k1") -> str:
    sandbox.inject(fault)
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    return outcome.operation_id


def test_nothing_due_is_left_alone(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "drop_after")
    report = reconciler(store, sandbox_provider).reconcile_once()
    assert report.picked == 0  # its first check is not due yet
    assert store.get("shop", op_id).state is State.OUTCOME_UNKNOWN


def test_dropped_response_resolved_succeeded_by_status_query(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "drop_after")
    make_due(store, op_id)
    report = reconciler(store, sandbox_provider).reconcile_once()
    assert report.outcomes == Counter({"succeeded": 1})
    record = store.get("shop", op_id)
    assert record.state is State.SUCCEEDED and record.resolution == "status_query"
    assert record.provider_reference is not None
    assert effects(sandbox, store, op_id) == 1
    last = store.events("shop", op_id)[-1]
    assert last.kind == "status_query" and last.to_state == "succeeded"
    # The client's retry now replays the resolved outcome.
    again = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="k1", request=PAYMENT
    )
    assert again.replayed and again.state is State.SUCCEEDED


def test_not_found_within_grace_stays_unknown(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "error_500_before")
    make_due(store, op_id)
    report = reconciler(
        store, sandbox_provider, not_found_grace=timedelta(hours=1)
    ).reconcile_once()
    assert report.outcomes == Counter({"not_found_waiting": 1})
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.checks == 1
    assert record.next_check_at is not None
    assert sandbox.ledger() == []


def test_not_found_after_grace_resubmits_with_the_same_key(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "error_500_before")
    before = store.get("shop", op_id)
    make_due(store, op_id)
    age(store, op_id, timedelta(minutes=5))
    report = reconciler(
        store, sandbox_provider, not_found_grace=timedelta(minutes=1)
    ).reconcile_once()
    assert report.outcomes == Counter({"resubmitted_succeeded": 1})
    record = store.get("shop", op_id)
    assert record.state is State.SUCCEEDED and record.resolution == "resubmission"
    (entry,) = sandbox.ledger()
    assert entry["idempotency_key"] == before.downstream_key
    kinds = [e.kind for e in store.events("shop", op_id)]
    assert kinds[-2:] == ["resubmit", "resubmission"]


def test_provider_without_keys_is_never_re_sent(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    op_id = unknown_after(executor, sandbox, "error_500_before")
    make_due(store, op_id)
    age(store, op_id, timedelta(hours=1))
    keyless = SandboxProvider(base_url=sandbox.url, idempotency_window=None, timeout=FAST_TIMEOUT)
    with keyless:
        report = reconciler(store, keyless, not_found_grace=timedelta(0)).reconcile_once()
    assert report.outcomes == Counter({"escalated": 1})
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert sandbox.ledger() == []


def test_past_the_key_window_is_escalated_not_re_sent(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "error_500_before")
    make_due(store, op_id)
    age(store, op_id, timedelta(hours=30))  # the sandbox honours keys for 24 h
    report = reconciler(store, sandbox_provider, not_found_grace=timedelta(0)).reconcile_once()
    assert report.outcomes == Counter({"escalated": 1})
    assert store.get("shop", op_id).needs_attention
    assert sandbox.ledger() == []


def test_abandoned_in_progress_is_released_without_asking_the_provider(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    new = (
        default_registry("sandbox")
        .prepare(tenant_id="shop", operation="payment.create", idempotency_key="a", request=PAYMENT)
        .new
    )
    claimed = store.claim(new, owner="gone", lease=timedelta(seconds=30), possibly_sent=False)
    make_due(store, claimed.operation.id)
    rec = reconciler(store, sandbox_provider)
    report = rec.reconcile_once()
    assert report.outcomes == Counter({"abandoned": 1})
    record = store.get("shop", claimed.operation.id)
    # Nothing was sent, so no outcome is stored: released, and not due again.
    assert record.released and record.state is State.IN_PROGRESS
    assert record.lease_owner is None and record.response is None
    assert record.next_check_at is None and rec.reconcile_once().picked == 0
    assert store.events("shop", record.id)[-1].kind == "abandoned"
    assert sandbox.ledger() == []
    # The key's next request runs the same operation, under the same downstream key.
    ex = Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        sleep=RecordingSleep(),
    )
    outcome = ex.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="a", request=PAYMENT
    )
    assert outcome.state is State.SUCCEEDED and outcome.operation_id == record.id
    assert effects(sandbox, store, record.id) == 1 and len(sandbox.ledger()) == 1


def test_provider_unavailable_backs_off_and_flags_after_max_checks(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    op_id = unknown_after(executor, sandbox, "drop_after")
    down = SandboxProvider(base_url="http://127.0.0.1:9", timeout=FAST_TIMEOUT)
    rec = reconciler(store, down, max_checks=3)
    with down:
        for check in range(1, 4):
            make_due(store, op_id)
            report = rec.reconcile_once()
            assert report.outcomes == Counter({"provider_unavailable": 1})
            record = store.get("shop", op_id)
            assert record.state is State.OUTCOME_UNKNOWN and record.checks == check
            assert record.needs_attention is (check >= 3)


def test_pending_stays_unknown_until_settled(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "pending")
    make_due(store, op_id)
    rec = reconciler(store, sandbox_provider)
    assert rec.reconcile_once().outcomes == Counter({"pending": 1})
    (entry,) = effects_of(sandbox, store, "shop", op_id)
    sandbox.settle(entry["id"])
    make_due(store, op_id)
    assert rec.reconcile_once().outcomes == Counter({"succeeded": 1})
    assert effects(sandbox, store, op_id) == 1


def test_stop_flag_releases_the_batch_untouched(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    ids = [unknown_after(executor, sandbox, "drop_after", key=f"k{i}") for i in range(3)]
    for op_id in ids:
        make_due(store, op_id)
    stop = threading.Event()
    stop.set()
    report = reconciler(store, sandbox_provider).reconcile_once(stop=stop)
    assert report.picked == 3 and report.released == 3 and not report.outcomes
    for op_id in ids:
        record = store.get("shop", op_id)
        assert record.state is State.OUTCOME_UNKNOWN and record.lease_owner is None
    assert reconciler(store, sandbox_provider).reconcile_once().outcomes == Counter(
        {"succeeded": 3}
    )


def test_daemon_runs_passes_until_stopped(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "drop_after")
    make_due(store, op_id)
    settled = threading.Event()

    def on_report(report: ReconcileReport) -> None:
        if report.outcomes.get("succeeded"):
            settled.set()

    daemon = ReconcilerDaemon(
        reconciler(store, sandbox_provider), interval=timedelta(seconds=0.05), on_report=on_report
    )
    daemon.start()
    try:
        assert settled.wait(timeout=30)
    finally:
        daemon.stop()
    assert store.get("shop", op_id).state is State.SUCCEEDED
    assert daemon.total.outcomes["succeeded"] == 1


@pytest.mark.slow
def test_two_reconciler_processes_over_500_due_operations(
    postgres_url: str, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    store = Store.from_url(postgres_url)
    try:
        ex = Executor(
            store=store,
            providers=[sandbox_provider],
            registry=default_registry("sandbox"),
            lease=timedelta(seconds=30),
            sleep=RecordingSleep(),
        )
        sandbox.inject("error_500_after", times=500)
        ids = [
            ex.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key=f"bulk-{i}",
                request=PAYMENT,
            ).operation_id
            for i in range(500)
        ]
        with store.engine.begin() as conn:
            conn.execute(
                sa.update(operations).values(
                    next_check_at=sa.func.now() - sa.text("interval '1 hour'")
                )
            )
        # Each process reaches the sandbox through a proxy of its own, which holds its
        # requests until the other has one in flight too (at most 2 s, within the read
        # time-out), so that both take a share unless the machine starves one. Who did how
        # much is not asserted: only that all was done once.
        overlap = Overlap(2, hold=2.0)
        proxies = [OverlapProxy(sandbox.url, overlap, f"worker-{w}") for w in range(2)]
        ctx = multiprocessing.get_context("spawn")
        try:
            with ctx.Manager() as manager, ctx.Pool(2) as pool:
                start = manager.Barrier(2)
                reports = pool.starmap(
                    workers.reconcile_until_idle,
                    [(postgres_url, proxies[w].http_url, w, start) for w in range(2)],
                )
        finally:
            for proxy in proxies:
                proxy.close()
        assert sum(r["succeeded"] for r in reports) == 500
        with store.engine.connect() as conn:
            states = Counter(
                s
                for (s,) in conn.execute(
                    sa.select(operations.c.state).where(operations.c.id.in_(ids))
                )
            )
            queries = Counter(
                op
                for (op,) in conn.execute(
                    sa.select(events.c.operation_id).where(events.c.kind == "status_query")
                )
            )
        assert states == Counter({"succeeded": 500})
        assert set(queries) == set(ids) and set(queries.values()) == {1}
        assert sum(effects(sandbox, store, i) for i in ids) == 500
    finally:
        store.close()


def test_a_refused_resubmission_stays_unknown_and_is_tried_again(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "error_500_before")
    make_due(store, op_id)
    age(store, op_id, timedelta(minutes=5))
    rec = reconciler(store, sandbox_provider, not_found_grace=timedelta(minutes=1))
    sandbox.inject("rate_limit")
    assert rec.reconcile_once().outcomes == Counter({"resubmitted_outcome_unknown": 1})
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.possibly_sent
    assert sandbox.ledger() == []
    make_due(store, op_id)
    assert rec.reconcile_once().outcomes == Counter({"resubmitted_succeeded": 1})
    assert effects(sandbox, store, op_id) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "point", ["before_send", "after_commit", "between_retries", "after_record"]
)
def test_kill_9_at_every_fault_point_ends_with_one_effect(
    db_url: str, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider, point: str
) -> None:
    if point == "between_retries":
        sandbox.inject("rate_limit")
    workers.run_until_killed(db_url, sandbox.url, "k9", point)
    record = store.get_by_namespace("shop", "payment.create", "k9")
    # Time passes: the dead worker's lease expires, the not-found grace runs out.
    make_due(store, record.id)
    age(store, record.id, timedelta(minutes=5))
    rec = reconciler(store, sandbox_provider, not_found_grace=timedelta(minutes=1))
    rec.run_until_idle(max_passes=5)
    final = store.get("shop", record.id)
    assert final.state is State.SUCCEEDED
    assert effects(sandbox, store, record.id) == 1
    assert len(sandbox.ledger()) == 1
    # Each crash is settled by the evidence its point leaves: the status query finds the
    # committed effect; nothing reached the provider, so the same key is sent again.
    assert final.resolution == SETTLED_BY[point]
    if point == "after_commit":
        last = store.events("shop", record.id)[-1]
        assert last.kind == "status_query" and last.detail is not None
        assert last.detail["query"] == "status"


SETTLED_BY = {
    "before_send": "resubmission",
    "after_commit": "status_query",
    "between_retries": "resubmission",
    "after_record": "provider_answer",
}


def test_a_reconciler_scoped_to_tenants_leaves_the_others_alone(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider, executor: Executor
) -> None:
    sandbox.inject("drop_after", times=2)
    ours, theirs = (
        executor.execute(
            tenant_id=tenant, operation="payment.create", idempotency_key="k", request=PAYMENT
        )
        for tenant in ("ours", "theirs")
    )
    for outcome in (ours, theirs):
        assert outcome.state is State.OUTCOME_UNKNOWN
        make_due(store, outcome.operation_id)
    scoped = Reconciler(
        store=store,
        providers=[sandbox_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30)),
        tenant_ids=["ours"],
    )
    assert scoped.reconcile_once().outcomes == Counter({"succeeded": 1})
    assert store.get("ours", ours.operation_id).state is State.SUCCEEDED
    assert store.get("theirs", theirs.operation_id).state is State.OUTCOME_UNKNOWN


def test_the_window_closing_mid_batch_escalates_without_sending(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    op_id = unknown_after(executor, sandbox, "error_500_before")
    make_due(store, op_id)
    age(store, op_id, timedelta(hours=23, minutes=55))  # past window (24 h) - margin (10 min)
    created = store.get("shop", op_id).created_at
    # A slow batch: the reconciler's idea of "now" is stale and still inside the window.
    store.db_time = lambda: created + timedelta(hours=23)  # type: ignore[method-assign]
    rec = reconciler(store, sandbox_provider, not_found_grace=timedelta(minutes=1))
    assert rec.reconcile_once().outcomes == Counter({"escalated": 1})
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert record.lease_owner is None
    assert sandbox.ledger() == []  # the UPDATE's own window test refused the re-send


def test_an_adapter_failure_during_resubmission_is_recorded(
    executor: Executor, sandbox: SandboxServer, store: Store, sandbox_provider: SandboxProvider
) -> None:
    class Broken(SandboxProvider):
        def submit(self, request: Any) -> Any:
            raise RuntimeError("adapter bug in submit")

    op_id = unknown_after(executor, sandbox, "error_500_before")
    make_due(store, op_id)
    age(store, op_id, timedelta(minutes=5))
    with Broken(base_url=sandbox.url, timeout=FAST_TIMEOUT) as broken:
        rec = reconciler(store, broken, not_found_grace=timedelta(minutes=1))
        assert rec.reconcile_once().outcomes == Counter({"resubmitted_outcome_unknown": 1})
    events = [e.kind for e in store.events("shop", op_id)]
    assert events[-2:] == ["resubmit", "resubmission"]
    record = store.get("shop", op_id)
    # The exception is classified as possibly sent: unknown, flagged, asked again later.
    assert record.state is State.OUTCOME_UNKNOWN and record.possibly_sent
    assert record.needs_attention
    assert sandbox.ledger() == []
