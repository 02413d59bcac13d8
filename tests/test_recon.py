"""Settlement reports as evidence (issue 37): a day of payments with faults, the sandbox's
report of it imported, and what each row proves.

The sandbox acquirer runs on loopback and the store is real (SQLite, PostgreSQL, Citus).
The day: a payment settled normally; an unknown left open (the answer dropped after the
commit); a claim lost in a failover; a key reused past the provider's window that charged
twice; a refund; a decline. The report's rows settle the unknown (``resolution=settlement``),
flag the duplicate with both references, list the orphan (adopted afterwards), check the
batch, and leave the payment the report did not show expected. A second import changes
nothing. Effects are counted at the sandbox throughout: importing calls no provider.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from unexplained_helpers import PAYMENT, TENANT, lose, make_executor, pay

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox._faults import Fault
from payorch.recon import ReconPolicy, RowClass, adopt_orphan, build_report, import_report
from payorch.reconciling._findings import Verdict
from payorch.storage._store import Store
from payorch.storage._tables import operations

pytestmark = pytest.mark.usefixtures("no_key_scope")
FEE = 30  # minor units the sandbox's report takes per capture


@pytest.fixture
def executor(store: Store, sandbox_provider: SandboxProvider) -> Executor:
    return make_executor(store, sandbox_provider)


@dataclass
class Day:
    settled: Outcome  # a payment that went through
    unknown: Outcome  # its answer dropped after the commit: outcome_unknown, left open
    lost_key: str  # a payment whose claim a failover lost: its effect is an orphan
    lost_effect: str
    twice: Outcome  # its key reused past the window after a lost claim: charged twice
    first_charge: str
    refund: Outcome
    declined: Outcome
    late: Outcome  # succeeded, and not in the day's report


def snapshot(store: Store) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(operations).order_by(operations.c.id)).mappings()
        return [dict(r) for r in rows]


def a_day(store: Store, executor: Executor, sandbox: SandboxServer) -> Day:
    settled = pay(executor, "order-1")
    sandbox.inject(Fault.DROP_AFTER)
    unknown = pay(executor, "order-2")
    lost = pay(executor, "order-3")
    lose(store, lost.operation_id)
    first = pay(executor, "order-4")
    lose(store, first.operation_id)
    sandbox.advance(timedelta(hours=25))  # past the acquirer's idempotency window
    twice = pay(executor, "order-4")  # the client's retry re-creates the claim: a 2nd charge
    refund = executor.execute(
        tenant_id=TENANT,
        operation="refund.create",
        idempotency_key="refund-1",
        request={"payment_intent": settled.provider_reference, "amount": 1000},
    )
    sandbox.inject(Fault.DECLINE)
    declined = pay(executor, "order-5")
    late = pay(executor, "order-6")
    assert lost.provider_reference is not None and first.provider_reference is not None
    return Day(
        settled=settled,
        unknown=unknown,
        lost_key="order-3",
        lost_effect=lost.provider_reference,
        twice=twice,
        first_charge=first.provider_reference,
        refund=refund,
        declined=declined,
        late=late,
    )


def test_a_day_of_faults_reconciles_from_the_settlement_report(
    store: Store, executor: Executor, sandbox: SandboxServer
) -> None:
    day = a_day(store, executor, sandbox)
    assert day.unknown.state is State.OUTCOME_UNKNOWN
    assert day.twice.state is State.SUCCEEDED and day.declined.state is State.FAILED_FINAL
    assert day.twice.provider_reference != day.first_charge
    effects_before = len(sandbox.ledger())
    assert day.late.provider_reference is not None
    shown = [e["id"] for e in sandbox.ledger() if e["id"] != day.late.provider_reference]
    report = sandbox.settlement_report(batch=1, fee=lambda _amount: FEE, effects=shown)

    result = import_report(store, report, provider="sandbox", name="day-1.csv")

    counts = result.counts
    assert counts == {
        "matched": 3,  # the settled payment, the refund, the namespace's own (second) charge
        "settles_unknown": 1,
        "orphan": 1,
        "duplicate": 1,
        "other": 1,  # the payout
    }, counts
    verdicts = {v.klass: v for v in result.verdicts}
    # The unknown is settled by the row, as a status query would, and audited as such.
    unknown = store.get(TENANT, day.unknown.operation_id)
    assert unknown.state is State.SUCCEEDED and unknown.resolution == "settlement"
    assert not unknown.needs_attention
    kinds = [e.kind for e in store.events(TENANT, unknown.id)]
    assert kinds[-1] == "settlement"
    # The second charge for one namespace: flagged, with both references.
    twice = store.get(TENANT, day.twice.operation_id)
    assert twice.needs_attention and twice.state is State.SUCCEEDED
    dup = verdicts[RowClass.DUPLICATE]
    assert dup.operation is not None and dup.operation.id == twice.id
    assert sorted(dup.detail["references"]) == sorted([day.first_charge, twice.provider_reference])
    events = store.events(TENANT, twice.id)
    assert events[-1].kind == "settlement_duplicate"
    # The batch: its rows' net against the payout.
    (batch,) = result.batches
    assert batch.status == "balanced" and batch.difference == 0
    assert batch.rows == 7  # six effects and the payout
    # The payment the report did not show: expected, not flagged before the lag.
    (expected,) = result.expected.items
    assert expected.operation.id == day.late.operation_id and not expected.overdue
    # Importing calls no provider: the acquirer holds what it held.
    assert len(sandbox.ledger()) == effects_before

    # The orphan is listed, adoptable, and adopted as its lost claim's operation.
    listed = build_report(store, provider="sandbox")
    orphans = [r for r in listed.listed if r.klass == "orphan"]
    assert [o.reference for o in orphans] == [day.lost_effect]
    assert orphans[0].refusal is None
    finding = adopt_orphan(
        store, "sandbox", orphans[0].row_key, actor="ops@shop", reason="settlement orphan"
    )
    assert finding.verdict is Verdict.ADOPTED
    adopted = store.get(TENANT, finding.operation_id or "")
    assert adopted.state is State.SUCCEEDED and adopted.provider_reference == day.lost_effect
    # The client's retry now replays it: no second charge.
    retry = pay(executor, day.lost_key)
    assert retry.replayed and retry.operation_id == adopted.id
    assert len(sandbox.ledger()) == effects_before

    # A second import of the same file changes nothing.
    before = snapshot(store)
    again = import_report(store, report, provider="sandbox", name="day-1.csv")
    assert not again.new_file and again.new_rows == 0 and again.verdicts == ()
    assert snapshot(store) == before

    # The next day's batch holds the late payment: matched, nothing expected any more.
    late = [day.late.provider_reference]
    day2 = sandbox.settlement_report(batch=2, fee=lambda _amount: FEE, effects=late)
    second = import_report(store, day2, provider="sandbox", name="day-2.csv")
    assert second.new_file and second.counts == {"matched": 1, "other": 1}
    assert second.expected.items == ()
    assert [b.status for b in second.batches] == ["balanced"]
    # A file overlapping both (every row already imported): new, and nothing in it is.
    before = snapshot(store)
    overlap = report + day2.split(b"\n", 1)[1]  # one report of both days' payouts
    third = import_report(store, overlap, provider="sandbox", name="days-1-2.csv")
    assert third.new_file and third.new_rows == 0 and third.verdicts == ()
    assert snapshot(store) == before
    assert len(sandbox.ledger()) == effects_before


def test_the_refund_row_matches_the_refund_not_the_payment(
    store: Store, executor: Executor, sandbox: SandboxServer
) -> None:
    paid = pay(executor, "order-r")
    refund = executor.execute(
        tenant_id=TENANT,
        operation="refund.create",
        idempotency_key="refund-r",
        request={"payment_intent": paid.provider_reference},
    )
    result = import_report(store, sandbox.settlement_report(), provider="sandbox")
    matched = {v.operation.id for v in result.verdicts if v.operation is not None}
    assert matched == {paid.operation_id, refund.operation_id}
    assert result.counts == {"matched": 2, "other": 1}
    assert PAYMENT["amount"] == store.get(TENANT, paid.operation_id).amount


def test_an_operation_missing_past_the_lag_is_flagged_and_counted(
    store: Store, executor: Executor, sandbox: SandboxServer
) -> None:
    shown = pay(executor, "order-a")
    missing = pay(executor, "order-b")
    only = [shown.provider_reference or ""]
    report = sandbox.settlement_report(effects=only)

    within = import_report(store, report, provider="sandbox")
    assert [i.operation.id for i in within.expected.items] == [missing.operation_id]
    assert not within.expected.items[0].overdue
    assert not store.get(TENANT, missing.operation_id).needs_attention

    past = import_report(
        store, report, provider="sandbox", policy=ReconPolicy(settlement_lag=timedelta(0))
    )
    assert past.expected.overdue == 1
    flagged = store.get(TENANT, missing.operation_id)
    assert flagged.needs_attention and flagged.state is State.SUCCEEDED
    assert store.events(TENANT, flagged.id)[-1].kind == "settlement_overdue"
    (owed,) = store.read_gauges()["recon"]["providers"]
    assert (owed["provider"], owed["expected"], owed["overdue"]) == ("sandbox", 1, 1)
    assert owed["counts"] == {"matched": 1, "other": 1}
    assert owed["oldest_expected_age"] >= 0


def test_the_metrics_count_rows_by_class_and_show_duplicates_and_the_expected(
    store: Store, executor: Executor, sandbox: SandboxServer
) -> None:
    from payorch import metrics as public
    from payorch.observing import _metrics

    def sample(name: str, **labels: str) -> float:
        return public.registry.get_sample_value(name, labels) or 0.0

    escalations = sample("payorch_escalations_total", reason="evidence")
    first = pay(executor, "order-9")
    lose(store, first.operation_id)
    sandbox.advance(timedelta(hours=25))
    pay(executor, "order-9")  # the same key past the window: a second charge
    late = pay(executor, "order-10")
    shown = [e["id"] for e in sandbox.ledger() if e["id"] != late.provider_reference]
    import_report(store, sandbox.settlement_report(effects=shown), provider="sandbox")

    # The duplicate flagged its operation for a human: counted as an escalation.
    assert sample("payorch_escalations_total", reason="evidence") == escalations + 1
    try:
        assert public.watch(store) is not None
        rows = {
            klass: sample("payorch_recon_rows_total", provider="sandbox", **{"class": klass})
            for klass in ("matched", "duplicate", "orphan", "other")
        }
        assert rows == {"matched": 1, "duplicate": 1, "orphan": 0, "other": 1}
        assert sample("payorch_recon_duplicates", provider="sandbox") == 1
        assert sample("payorch_recon_expected_operations", provider="sandbox") == 1
        assert sample("payorch_recon_overdue_operations", provider="sandbox") == 0
    finally:
        for gauges in list(_metrics._watched):
            public.registry.unregister(gauges)
        _metrics._watched.clear()
