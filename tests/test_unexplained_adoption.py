"""Effects no operation explains, found in review (issue 34): what an adoption stages in the
outbox, which operation may explain an effect, and whose effects a sharded daemon adopts.

The sandbox acquirer and the Stripe emulator run on loopback (their ledgers count the
effects); the store is real (SQLite and PostgreSQL). A lost claim is what an asynchronous
failover leaves: the effect at the provider, no row (nor anything it staged) here.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from stripe_emulator import StripeEmulator
from unexplained_helpers import (
    PAYMENT,
    REGISTRY,
    TENANT,
    lose,
    make_executor,
    namespace_ops,
    pay,
    window,
)

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.outbox import Message, OutboxHooks
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._daemon import ReconcilerDaemon
from payorch.reconciling._reconciler import Reconciler
from payorch.reconciling._unexplained import Verdict, scan
from payorch.reconciling._watch import UnexplainedWatch
from payorch.records import OperationRecord
from payorch.storage._outbox import stable_id
from payorch.storage._store import Store
from payorch.storage._tables import events, operations, outbox

# The installation's key scope is the environment's: none unless a test sets one.
pytestmark = pytest.mark.usefixtures("no_key_scope")

OTHER_TENANT = "shop-b"


def receipts() -> OutboxHooks:
    hooks = OutboxHooks()

    @hooks.on("payment.create", "succeeded", name="receipt")
    def paid(op: OperationRecord) -> list[Message]:
        data = {"operation_id": op.id, "amount": op.amount, "reference": op.provider_reference}
        return [Message("receipt.requested", "payment", op.id, data, destination="ledger")]

    return hooks


@pytest.fixture
def hooked(db_url: str) -> Iterator[Store]:
    """The operators' store: the application's outbox hooks (``PAYORCH_OUTBOX_HOOKS``)."""
    store = Store.from_url(db_url, outbox_hooks=receipts())
    yield store
    store.close()


def staged(store: Store) -> list[dict[str, object]]:
    with store.engine.connect() as conn:
        found = conn.execute(sa.select(outbox).order_by(outbox.c.seq))
        return [dict(r) for r in found.mappings()]


# -- an adoption stages what settling stages ----------------------------------------------


def test_adopting_a_fresh_effect_stages_the_outbox_hooks_messages_once(
    store: Store, hooked: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    first = pay(make_executor(store, sandbox_provider), "k-hooked")  # stages nothing: no hooks
    lose(store, first.operation_id)
    assert staged(hooked) == []

    report = scan(
        hooked,
        sandbox_provider,
        **window(),
        adopt_found=True,
        actor="alice",
        reason="claim lost in the failover",
        registry=REGISTRY,
    )

    (finding,) = report.findings
    assert finding.verdict is Verdict.ADOPTED and not finding.nothing_sent
    adopted = hooked.get(TENANT, finding.operation_id or "")
    assert adopted.state is State.SUCCEEDED
    (message,) = staged(hooked)  # the money moved: its receipt is staged, once
    assert (message["type"], message["destination"]) == ("receipt.requested", "ledger")
    assert message["operation_id"] == adopted.id and message["state"] == "pending"
    assert message["payload"] == {
        "operation_id": adopted.id,
        "amount": 4200,
        "reference": first.provider_reference,
    }
    # The id a settling write of the same outcome stages: receivers dedupe on it.
    assert message["id"] == stable_id(adopted, "receipt", 0)

    # The client's retry replays (stages nothing); a look again adopts nothing more.
    retry = pay(make_executor(hooked, sandbox_provider), "k-hooked")
    assert retry.replayed and retry.operation_id == adopted.id
    again = scan(hooked, sandbox_provider, **window(), adopt_found=True, actor="a", reason="r")
    assert [f.verdict for f in again.findings] == [Verdict.EXPLAINED]
    assert len(staged(hooked)) == 1
    assert len(sandbox.ledger()) == 1


# -- an effect is explained only by an operation of its own type ---------------------------


def test_a_lost_create_is_not_explained_by_the_capture_of_its_intent(
    store: Store, stripe_emulator: StripeEmulator
) -> None:
    stripe = stripe_emulator.adapter()
    executor = Executor(
        store=store,
        providers=[stripe],
        registry=default_registry("stripe"),
        lease=timedelta(minutes=5),
        sleep=lambda _seconds: None,
    )
    auth = {"amount": 2000, "currency": "usd", "payment_method": "pm_card_visa"}
    created = executor.execute(
        tenant_id=TENANT,
        operation="payment.create",
        idempotency_key="order-captured",
        request={**auth, "capture_method": "manual"},
    )
    intent = created.provider_reference
    assert created.state is State.SUCCEEDED and intent is not None
    captured = executor.execute(
        tenant_id=TENANT,
        operation="payment.capture",
        idempotency_key="capture-order-captured",
        request={"payment_intent": intent},
    )
    assert captured.state is State.SUCCEEDED and captured.provider_reference == intent
    key = store.get(TENANT, created.operation_id).downstream_key
    lose(store, created.operation_id)  # the create's claim is gone; the capture's is not

    (listed,) = scan(store, stripe, **window()).findings
    assert listed.effect.provider_reference == intent
    assert listed.verdict is Verdict.UNEXPLAINED and listed.adoptable  # not "explained"

    report = scan(store, stripe, **window(), adopt_found=True, actor="alice", reason="failover")

    (finding,) = report.findings
    assert finding.verdict is Verdict.ADOPTED
    adopted = store.get(TENANT, finding.operation_id or "")
    assert (adopted.operation, adopted.state, adopted.provider_reference) == (
        "payment.create",
        State.SUCCEEDED,
        intent,
    )
    assert adopted.downstream_key == key
    # The client's retry of the create replays: no second PaymentIntent, whatever its age.
    retry = executor.execute(
        tenant_id=TENANT,
        operation="payment.create",
        idempotency_key="order-captured",
        request={**auth, "capture_method": "manual"},
    )
    assert retry.replayed and retry.operation_id == adopted.id
    assert len(stripe_emulator.intents(key)) == 1
    assert store.get(TENANT, captured.operation_id).state is State.SUCCEEDED  # untouched


# -- a sharded daemon's look adopts only its own tenants' effects --------------------------


def pay_as(executor: Executor, tenant: str, key: str) -> Outcome:
    return executor.execute(
        tenant_id=tenant, operation="payment.create", idempotency_key=key, request=PAYMENT
    )


def lose_as(store: Store, tenant: str, operation_id: str) -> None:
    """A failover's loss of one claim of ``tenant`` (its rows gone)."""
    with store.engine.begin() as conn:
        for table, column in ((events, events.c.operation_id), (operations, operations.c.id)):
            conn.execute(
                sa.delete(table).where(table.c.tenant_id == tenant, column == operation_id)
            )


def tenants_ops(store: Store, tenant: str) -> list[str]:
    with store.engine.connect() as conn:
        query = sa.select(operations.c.id).where(operations.c.tenant_id == tenant)
        return list(conn.execute(query).scalars())


def test_a_sharded_daemons_look_adopts_only_its_tenants_effects(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    executor = make_executor(store, sandbox_provider)
    mine = pay_as(executor, TENANT, "k-shard")
    theirs = pay_as(executor, OTHER_TENANT, "k-shard")
    lose_as(store, TENANT, mine.operation_id)
    lose_as(store, OTHER_TENANT, theirs.operation_id)
    shard = Reconciler(
        store=store, providers=[sandbox_provider], owner="reconciler:a", tenant_ids=[TENANT]
    )
    watch = UnexplainedWatch(
        store=store,
        providers=[sandbox_provider],
        every=timedelta(minutes=1),
        window=timedelta(minutes=10),
        adopt=True,
        actor=shard.owner,
    )

    daemon = ReconcilerDaemon(shard, interval=timedelta(seconds=30), unexplained=watch)
    assert daemon.unexplained is not None
    (report,) = daemon.unexplained.run()  # what the daemon's scheduled job runs

    assert report.listed == 2 and report.counts()["other_tenants"] == 1
    (finding,) = report.findings
    assert finding.verdict is Verdict.ADOPTED
    assert finding.effect.provider_reference == mine.provider_reference
    (adopted,) = namespace_ops(store, "k-shard")  # TENANT's namespace only
    assert adopted.tenant_id == TENANT and adopted.needs_attention
    assert tenants_ops(store, OTHER_TENANT) == []  # another shard's effect: left to it
    assert len(sandbox.ledger()) == 2

    # Its own shard's look adopts it.
    other = UnexplainedWatch(
        store=store,
        providers=[sandbox_provider],
        every=timedelta(minutes=1),
        window=timedelta(minutes=10),
        adopt=True,
        actor="reconciler:b",
        tenant_ids={OTHER_TENANT},
    )
    (theirs_report,) = other.run()
    assert theirs_report.counts()["adopted"] == 1
    assert theirs_report.counts()["other_tenants"] == 1  # TENANT's, explained by its shard
    assert len(tenants_ops(store, OTHER_TENANT)) == 1
