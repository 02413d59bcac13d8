"""Effects no operation explains (issue 21, item 5): a charge whose claim was lost.

The sandbox acquirer runs on loopback and the store is real (SQLite and PostgreSQL). A lost
claim is what an asynchronous failover leaves: the effect at the provider, no row here.
Stripe's listing is checked against respx.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import respx
import sqlalchemy as sa
from conftest import FAST_TIMEOUT

from payorch.cli.reconcile import unexplained_watch
from payorch.core import State, downstream_key, namespace_ref
from payorch.daemon import ReconcilerDaemon
from payorch.errors import (
    IdempotencyKeyReused,
    InvalidRequest,
    ListingUnsupported,
    ProviderListingFailed,
    UnknownProvider,
)
from payorch.executor import Executor
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.provider import (
    TAG_FINGERPRINT,
    AnswerKind,
    ProviderEffect,
    SubmitRequest,
    provider_tags,
)
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox.faults import Fault
from payorch.providers.stripe import StripeProvider
from payorch.providers.stripe import listing as stripe_listing
from payorch.reconciler import Reconciler
from payorch.records import OperationRecord
from payorch.settings import Settings
from payorch.store import Store
from payorch.tables import events, operations
from payorch.unexplained import (
    Finding,
    UnexplainedWatch,
    Verdict,
    adopt,
    adoption_refusal,
    scan,
)

REGISTRY = default_registry("sandbox")
PAYMENT = {"amount": 4200, "currency": "EUR", "customer": "cus_7", "payment_method": "pm_visa"}
TENANT = "shop-a"


@pytest.fixture
def executor(store: Store, sandbox_provider: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[sandbox_provider],
        registry=REGISTRY,
        lease=timedelta(seconds=30),
        owner="client-worker",
    )


def pay(executor: Executor, key: str, **changes: Any) -> Outcome:
    return executor.execute(
        tenant_id=TENANT,
        operation="payment.create",
        idempotency_key=key,
        request={**PAYMENT, **changes},
    )


def lose(store: Store, operation_id: str) -> None:
    """What a failover on asynchronous replication does to a claim: its rows are gone."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.delete(events).where(
                events.c.tenant_id == TENANT, events.c.operation_id == operation_id
            )
        )
        conn.execute(
            sa.delete(operations).where(
                operations.c.tenant_id == TENANT, operations.c.id == operation_id
            )
        )


def window() -> dict[str, datetime]:
    now = datetime.now(UTC)
    return {"since": now - timedelta(minutes=10), "until": now + timedelta(minutes=10)}


def by_reference(findings: list[Finding]) -> dict[str, Finding]:
    return {f.effect.provider_reference: f for f in findings}


def namespace_ops(store: Store, key: str) -> list[OperationRecord]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(operations).where(
                operations.c.tenant_id == TENANT, operations.c.idempotency_key == key
            )
        ).mappings()
        return [OperationRecord.from_row(r) for r in rows]


def post_untagged(sandbox: SandboxServer) -> str:
    """An effect someone else made at the same acquirer: no payorch metadata."""
    reply = httpx.post(
        f"{sandbox.url}/v1/operations/payment.create",
        json={"amount": 100, "currency": "EUR"},
        headers={"Idempotency-Key": f"other-system-{uuid.uuid4()}"},
    )
    assert reply.status_code == 200
    effect_id: str = reply.json()["id"]
    return effect_id


# -- listing against the store -------------------------------------------------------------


def test_a_lost_claim_is_unexplained_an_explained_one_is_not(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    kept = pay(executor, "k-kept")
    lost = pay(executor, "k-lost")
    lose(store, lost.operation_id)
    foreign = post_untagged(sandbox)

    report = scan(store, sandbox_provider, **window())

    assert report.listed == 3 and report.not_ours == 1
    found = by_reference(report.findings)
    assert foreign not in found
    assert kept.provider_reference is not None and lost.provider_reference is not None
    explained = found[kept.provider_reference]
    assert (explained.verdict, explained.operation_id) == (Verdict.EXPLAINED, kept.operation_id)
    assert explained.explained_by == "namespace"
    orphan = found[lost.provider_reference]
    assert orphan.verdict is Verdict.UNEXPLAINED and orphan.refusal is None
    assert orphan.effect.kind is AnswerKind.SUCCEEDED
    assert orphan.effect.tags["payorch_idempotency_key"] == "k-lost"
    assert report.counts()["unexplained"] == 1
    assert namespace_ops(store, "k-lost") == []  # a listing writes nothing


def test_adoption_makes_the_retry_replay_instead_of_charging_again(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    first = pay(executor, "k-failover")
    original = store.get(TENANT, first.operation_id)
    lose(store, first.operation_id)

    report = scan(
        store,
        sandbox_provider,
        **window(),
        adopt_found=True,
        actor="alice",
        reason="claim lost in the failover of 2024-05-01",
        registry=REGISTRY,
    )

    (finding,) = report.findings
    assert finding.verdict is Verdict.ADOPTED
    adopted = store.get(TENANT, finding.operation_id or "")
    assert adopted.state is State.SUCCEEDED and adopted.needs_attention
    assert adopted.provider_reference == first.provider_reference
    # The same namespace, fingerprint and downstream key as the lost claim: what the
    # provider saw.
    assert adopted.fingerprint == original.fingerprint
    assert adopted.downstream_key == original.downstream_key
    assert (adopted.amount, adopted.currency) == (4200, "EUR")
    (event,) = store.events(TENANT, adopted.id)
    assert (event.kind, event.actor, event.to_state) == ("adopted", "alice", "succeeded")
    assert event.detail is not None
    assert event.detail["reason"] == "claim lost in the failover of 2024-05-01"
    assert event.detail["evidence"]["object"]["id"] == first.provider_reference

    retry = pay(executor, "k-failover")
    assert retry.replayed and retry.state is State.SUCCEEDED
    assert retry.operation_id == adopted.id
    assert retry.provider_reference == first.provider_reference
    assert len(sandbox.effects_for(original.downstream_key)) == 1
    with pytest.raises(IdempotencyKeyReused):
        pay(executor, "k-failover", amount=9900)
    assert len(sandbox.ledger()) == 1  # ONE effect, whatever came after


def test_a_decline_is_adopted_final_and_a_pending_one_unknown(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    declined = pay(executor, "k-declined", payment_method="pm_card_declined")
    assert declined.state is State.FAILED_FINAL
    sandbox.inject(Fault.PENDING)
    pending = pay(executor, "k-pending")
    assert pending.state is State.OUTCOME_UNKNOWN
    lose(store, declined.operation_id)
    lose(store, pending.operation_id)

    report = scan(store, sandbox_provider, **window(), adopt_found=True, actor="a", reason="r")

    assert {f.verdict for f in report.findings} == {Verdict.ADOPTED}
    final = store.get_by_namespace(TENANT, "payment.create", "k-declined")
    assert (final.state, final.error_code, final.needs_attention) == (
        State.FAILED_FINAL,
        "generic_decline",
        True,
    )
    unknown = store.get_by_namespace(TENANT, "payment.create", "k-pending")
    assert unknown.state is State.OUTCOME_UNKNOWN and unknown.needs_attention
    assert unknown.next_check_at is not None  # due for the reconciler now

    again = pay(executor, "k-declined", payment_method="pm_card_declined")
    assert again.replayed and again.state is State.FAILED_FINAL and again.http_status == 402
    as_it_stands = pay(executor, "k-pending")
    assert (as_it_stands.state, as_it_stands.operation_id) == (State.OUTCOME_UNKNOWN, unknown.id)

    # The reconciler settles the adopted unknown by its provider reference.
    assert unknown.provider_reference is not None
    sandbox.settle(unknown.provider_reference)
    Reconciler(store=store, providers=[sandbox_provider]).run_until_idle()
    assert store.get(TENANT, unknown.id).state is State.SUCCEEDED
    assert len(sandbox.ledger()) == 2


def test_a_client_retry_that_claims_first_wins_cleanly(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    first = pay(executor, "k-race")
    lose(store, first.operation_id)
    (finding,) = scan(store, sandbox_provider, **window()).findings
    assert finding.verdict is Verdict.UNEXPLAINED

    # Before the operator adopts it, the client comes back: a new claim, the same
    # downstream key, and the acquirer's idempotency answers with the same effect.
    retry = pay(executor, "k-race")
    assert retry.provider_reference == first.provider_reference

    ended = adopt(store, finding, actor="alice", reason="lost claim")
    assert (ended.verdict, ended.operation_id) == (Verdict.EXPLAINED, retry.operation_id)
    (only,) = namespace_ops(store, "k-race")
    assert only.id == retry.operation_id and not only.needs_attention
    assert [e.kind for e in store.events(TENANT, only.id)] == ["claimed", "provider_answer"]
    assert len(sandbox.ledger()) == 1


def test_adoption_racing_a_claim_inserts_one_operation(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    first = pay(executor, "k-both")
    lose(store, first.operation_id)
    (finding,) = scan(store, sandbox_provider, **window()).findings
    results: list[Any] = []
    start = threading.Barrier(2)

    def adopter() -> None:
        start.wait()
        results.append(adopt(store, finding, actor="alice", reason="lost"))

    def client() -> None:
        start.wait()
        results.append(pay(executor, "k-both"))

    threads = [threading.Thread(target=adopter), threading.Thread(target=client)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    (only,) = namespace_ops(store, "k-both")
    assert only.state is State.SUCCEEDED
    assert only.provider_reference == first.provider_reference
    outcome = next(r for r in results if isinstance(r, Outcome))
    ended = next(r for r in results if isinstance(r, Finding))
    assert outcome.operation_id == ended.operation_id == only.id
    assert len(sandbox.ledger()) == 1


def _submit_tagged(
    sandbox_provider: SandboxProvider,
    *,
    key: str,
    downstream: str,
    fingerprint: str = "",
    op_id: str | None = None,
) -> str:
    """An effect made as payorch once made it (the earlier tags), straight at the sandbox."""
    answer = sandbox_provider.submit(
        SubmitRequest(
            tenant_id=TENANT,
            operation="payment.create",
            operation_id=op_id or str(uuid.uuid4()),
            downstream_key=downstream,
            payload=PAYMENT,
            idempotency_key=key,
            fingerprint=fingerprint,
        )
    )
    assert answer.kind is AnswerKind.SUCCEEDED and answer.provider_reference
    return answer.provider_reference


def test_legacy_and_fingerprintless_effects_are_listed_never_adopted(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    legacy = _submit_tagged(
        sandbox_provider, key="k-old", downstream=f"payorch:{uuid.uuid4()}:submit"
    )
    ref = namespace_ref(TENANT, "payment.create", "k-nofp")
    bare = _submit_tagged(sandbox_provider, key="k-nofp", downstream=downstream_key(ref))

    report = scan(store, sandbox_provider, **window(), adopt_found=True, actor="a", reason="r")

    found = by_reference(report.findings)
    assert found[legacy].verdict is Verdict.UNEXPLAINED
    assert "before keys came from the namespace" in (found[legacy].refusal or "")
    assert found[bare].verdict is Verdict.UNEXPLAINED
    assert TAG_FINGERPRINT in (found[bare].refusal or "")
    with pytest.raises(InvalidRequest, match="cannot be adopted"):
        adopt(store, found[bare], actor="a", reason="r")
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar_one() == 0


def test_a_legacy_effect_is_explained_by_its_operation_id(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    prepared = REGISTRY.prepare(
        tenant_id=TENANT, operation="payment.create", idempotency_key="k-leg", request=PAYMENT
    )
    record = store.claim(prepared.new, owner="w", lease=timedelta(minutes=1)).operation
    # Sent before keys came from the namespace: key and metadata name the operation id.
    reference = _submit_tagged(
        sandbox_provider, key="k-leg", downstream=f"payorch:{record.id}:submit", op_id=record.id
    )

    (finding,) = scan(store, sandbox_provider, **window()).findings

    assert finding.effect.provider_reference == reference
    assert finding.effect.tags["payorch_operation_id"] == record.id
    assert (finding.verdict, finding.explained_by) == (Verdict.EXPLAINED, "operation_id")
    assert finding.operation_id == record.id


def effect(**tags: str) -> ProviderEffect:
    return ProviderEffect(
        provider_reference="sbx_1",
        kind=AnswerKind.SUCCEEDED,
        amount=1,
        currency="EUR",
        created_at=datetime.now(UTC),
        tags=tags,
        object_type="effect",
    )


def test_adoption_refuses_tags_that_disagree_with_their_namespace() -> None:
    tags = provider_tags(
        tenant_id=TENANT,
        operation="payment.create",
        idempotency_key="k-1",
        operation_id="op",
        downstream_key=downstream_key(namespace_ref(TENANT, "payment.create", "k-1")),
        fingerprint="ab" * 32,
    )
    assert adoption_refusal(effect(**tags)) is None
    assert "not its namespace's" in (
        adoption_refusal(effect(**{**tags, "payorch_idempotency_key": "k-2"})) or ""
    )
    assert "SHA-256" in (adoption_refusal(effect(**{**tags, TAG_FINGERPRINT: "x"})) or "")
    seen_other_key = ProviderEffect(
        **{**vars(effect(**tags)), "downstream_key": "payorch:x:submit"}
    )
    assert "the provider saw key" in (adoption_refusal(seen_other_key) or "")
    unreadable = ProviderEffect(**{**vars(effect(**tags)), "kind": AnswerKind.AMBIGUOUS})
    assert "could not be read" in (adoption_refusal(unreadable) or "")


# -- the sandbox's listing -----------------------------------------------------------------


def test_the_sandbox_lists_by_creation_range_page_by_page(
    sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    made = [post_untagged(sandbox) for _ in range(205)]
    sandbox.advance(timedelta(hours=2))
    later = post_untagged(sandbox)

    listed = [e.provider_reference for e in sandbox_provider.list_effects(**window())]

    assert listed == made  # commit order, three pages, not the effect dated two hours on
    pages = [r for r in sandbox.requests() if r["path"].startswith("/v1/effects?")]
    assert len(pages) == 3
    assert "starting_after" in pages[1]["path"] and made[99] in pages[1]["path"]
    assert later not in listed


def test_a_listing_that_cannot_be_read_is_a_typed_error() -> None:
    def answer_503(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"type": "api_error"}})

    down = SandboxProvider(
        base_url="http://127.0.0.1:9",
        transport=httpx.MockTransport(answer_503),
        timeout=FAST_TIMEOUT,
    )
    with pytest.raises(ProviderListingFailed) as failed:
        list(down.list_effects(**window()))
    assert failed.value.code == "http_503"
    closed = SandboxProvider(base_url="http://127.0.0.1:9", timeout=FAST_TIMEOUT)
    with pytest.raises(ProviderListingFailed) as refused:
        list(closed.list_effects(**window()))
    assert refused.value.code == "ConnectError"
    assert "try again" in refused.value.message


def test_an_adapter_that_cannot_list_is_refused(store: Store) -> None:
    class SubmitsOnly:
        name = "acquirer"

    with pytest.raises(ListingUnsupported, match="'acquirer' cannot list"):
        scan(store, SubmitsOnly(), **window())


# -- Stripe's listing (respx) --------------------------------------------------------------

STRIPE = "http://127.0.0.1:12111/stripe"
CREATED = int(datetime(2024, 5, 1, 12, tzinfo=UTC).timestamp())


def intent(ident: str, status: str = "succeeded", **metadata: str) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "payment_intent",
        "amount": 4200,
        "currency": "eur",
        "status": status,
        "capture_method": "automatic",
        "created": CREATED,
        "client_secret": f"{ident}_secret_x",
        "metadata": metadata,
        "last_payment_error": {"decline_code": "insufficient_funds"}
        if status == "requires_payment_method"
        else None,
    }


def page(*items: dict[str, Any], has_more: bool = False) -> httpx.Response:
    return httpx.Response(200, json={"object": "list", "data": list(items), "has_more": has_more})


@pytest.fixture
def router() -> respx.Router:
    return respx.Router(base_url=STRIPE, assert_all_called=False)


@pytest.fixture
def stripe(router: respx.Router) -> Iterator[StripeProvider]:
    with StripeProvider(
        api_key="sk_test_x", base_url=STRIPE, transport=httpx.MockTransport(router.handler)
    ) as adapter:
        yield adapter


OURS = {
    "payorch_ref": namespace_ref(TENANT, "payment.create", "k-s"),
    "payorch_tenant_id": TENANT,
    "payorch_operation": "payment.create",
    "payorch_idempotency_key": "k-s",
    "payorch_fingerprint": "cd" * 32,
}


def test_stripe_lists_payment_intents_by_creation_page_by_page(
    stripe: StripeProvider, router: respx.Router
) -> None:
    intents = router.get("/v1/payment_intents").mock(
        side_effect=[
            page(intent("pi_1", **OURS), intent("pi_2", order="42"), has_more=True),
            page(intent("pi_3", "requires_payment_method", **OURS)),
        ]
    )
    refunds = router.get("/v1/refunds").mock(return_value=page())
    since = datetime(2024, 5, 1, tzinfo=UTC)

    listed = list(stripe.list_effects(since, since + timedelta(days=1)))

    assert [(e.provider_reference, e.kind) for e in listed] == [
        ("pi_1", AnswerKind.SUCCEEDED),
        ("pi_3", AnswerKind.DECLINED),
    ]  # pi_2 carries no payorch tags: not ours
    assert listed[1].code == "insufficient_funds"
    assert dict(listed[0].tags) == OURS
    assert (listed[0].amount, listed[0].currency) == (4200, "eur")
    assert "client_secret" not in listed[0].raw
    first, second = (c.request.url.params for c in intents.calls)
    assert (first["created[gte]"], first["limit"]) == (str(int(since.timestamp())), "100")
    assert "starting_after" not in first and second["starting_after"] == "pi_2"
    assert refunds.call_count == 1


def test_stripe_listing_failures_are_typed_and_bounded(
    stripe: StripeProvider, router: respx.Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    router.get("/v1/payment_intents").mock(return_value=httpx.Response(500, json={}))
    with pytest.raises(ProviderListingFailed) as failed:
        list(stripe.list_effects(**window()))
    assert failed.value.code == "http_500"

    monkeypatch.setattr(stripe_listing, "MAX_LIST_PAGES", 2)
    router.get("/v1/payment_intents").mock(return_value=page(intent("pi_9"), has_more=True))
    with pytest.raises(ProviderListingFailed) as bounded:
        list(stripe.list_effects(**window()))
    assert bounded.value.code == "too_many_pages"


def test_a_stripe_effect_is_adopted_under_its_namespace(
    store: Store, stripe: StripeProvider, router: respx.Router
) -> None:
    router.get("/v1/payment_intents").mock(return_value=page(intent("pi_lost", **OURS)))
    router.get("/v1/refunds").mock(return_value=page())
    since = datetime(2024, 5, 1, tzinfo=UTC)

    report = scan(
        store,
        stripe,
        since=since,
        until=since + timedelta(days=1),
        adopt_found=True,
        actor="alice",
        reason="lost",
        registry=default_registry("stripe"),
    )

    (finding,) = report.findings
    adopted = store.get(TENANT, finding.operation_id or "")
    assert (adopted.provider, adopted.state, adopted.currency) == ("stripe", State.SUCCEEDED, "EUR")
    assert adopted.downstream_key == downstream_key(OURS["payorch_ref"])
    assert adopted.fingerprint == OURS["payorch_fingerprint"]


# -- the daemon's scheduled look -----------------------------------------------------------


def test_the_daemon_adopts_on_its_schedule_when_asked(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    lost = pay(executor, "k-daemon")
    lose(store, lost.operation_id)
    rec = Reconciler(store=store, providers=[sandbox_provider], owner="reconciler:test")
    config = Settings(unexplained_every_seconds=0.2, unexplained_adopt=True)
    watch = unexplained_watch(rec, config)
    assert isinstance(watch, UnexplainedWatch)
    daemon = ReconcilerDaemon(rec, interval=timedelta(seconds=30), unexplained=watch)
    daemon.start()
    try:
        deadline = datetime.now(UTC) + timedelta(seconds=20)
        while not namespace_ops(store, "k-daemon") and datetime.now(UTC) < deadline:
            threading.Event().wait(0.05)
    finally:
        daemon.stop()
    (adopted,) = namespace_ops(store, "k-daemon")
    assert adopted.needs_attention and adopted.state is State.SUCCEEDED
    assert [(e.kind, e.actor) for e in store.events(TENANT, adopted.id)] == [
        ("adopted", "reconciler:test")
    ]


def test_the_daemon_look_is_off_by_default_and_checks_its_providers(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    rec = Reconciler(store=store, providers=[sandbox_provider])
    assert unexplained_watch(rec, Settings()) is None
    listing_only = unexplained_watch(rec, Settings(unexplained_every_seconds=60))
    assert listing_only is not None and not listing_only.adopt
    assert [p.name for p in listing_only.providers] == ["sandbox"]
    with pytest.raises(UnknownProvider, match="stripe"):
        unexplained_watch(
            rec, Settings(unexplained_every_seconds=60, unexplained_providers="sandbox,stripe")
        )
