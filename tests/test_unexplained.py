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

from payorch.cli._reconcile import unexplained_watch
from payorch.core import State, downstream_key, namespace_ref
from payorch.errors import (
    ConfigurationError,
    IdempotencyKeyReused,
    InvalidRequest,
    ListingUnsupported,
    ProviderListingFailed,
    ProviderUnavailable,
    UnknownProvider,
)
from payorch.execution._executor import Executor, RetryPolicy
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
from payorch.providers.sandbox._faults import Fault
from payorch.providers.stripe import StripeProvider
from payorch.providers.stripe import _listing as stripe_listing
from payorch.reconciling import _unexplained as unexplained
from payorch.reconciling._daemon import ReconcilerDaemon
from payorch.reconciling._reconciler import Reconciler
from payorch.reconciling._unexplained import (
    Finding,
    Verdict,
    adopt,
    adoption_refusal,
    explain,
    not_ours,
    scan,
)
from payorch.reconciling._watch import UnexplainedWatch
from payorch.records import OperationRecord
from payorch.settings import Settings
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

REGISTRY = default_registry("sandbox")
PAYMENT = {"amount": 4200, "currency": "EUR", "customer": "cus_7", "payment_method": "pm_visa"}
TENANT = "shop-a"


@pytest.fixture(autouse=True)
def _no_key_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installation's key scope is the environment's: none unless a test sets one."""
    monkeypatch.delenv("PAYORCH_KEY_SCOPE", raising=False)


def make_executor(
    store: Store, sandbox_provider: SandboxProvider, *, key_scope: str | None = None
) -> Executor:
    return Executor(
        store=store,
        providers=[sandbox_provider],
        registry=REGISTRY,
        lease=timedelta(seconds=30),
        owner="client-worker",
        sleep=lambda _seconds: None,  # inline retries of a refused attempt wait for nothing
        key_scope=key_scope,
    )


@pytest.fixture
def executor(store: Store, sandbox_provider: SandboxProvider) -> Executor:
    return make_executor(store, sandbox_provider)


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
    return post_with(sandbox, {}, key=f"other-system-{uuid.uuid4()}")


def post_with(sandbox: SandboxServer, metadata: dict[str, str], *, key: str | None = None) -> str:
    """An effect made straight at the acquirer, with this metadata (the tags it carries)."""
    reply = httpx.post(
        f"{sandbox.url}/v1/operations/payment.create",
        json={"amount": 100, "currency": "EUR", "metadata": metadata},
        headers={"Idempotency-Key": key or f"payorch:{uuid.uuid4().hex}:submit"},
    )
    assert reply.status_code == 200
    effect_id: str = reply.json()["id"]
    return effect_id


def release(executor: Executor, sandbox: SandboxServer, key: str) -> OperationRecord:
    """The client's retry of a lost claim while the acquirer refuses every attempt (429,
    nothing sent): the claim is re-created, then released, nothing stored as its answer."""
    sandbox.inject(Fault.RATE_LIMIT, times=RetryPolicy().max_attempts)
    with pytest.raises(ProviderUnavailable) as caught:
        pay(executor, key)
    record = executor.store.get(TENANT, caught.value.operation_id or "")
    assert record.released and record.provider_reference is None
    return record


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


# -- a released operation explains nothing -----------------------------------------------


def test_a_released_operation_does_not_explain_a_real_effect_and_is_adopted(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    # A failover loses the claim that charged; the client's retry re-creates it while the
    # acquirer refuses every attempt, so it is released; then the client gives up.
    first = pay(executor, "k-released")
    original = store.get(TENANT, first.operation_id)
    lose(store, first.operation_id)
    held = release(executor, sandbox, "k-released")
    assert held.downstream_key == original.downstream_key  # the same namespace, re-created

    (listed,) = scan(store, sandbox_provider, **window()).findings
    assert listed.verdict is Verdict.UNEXPLAINED and listed.adoptable
    assert listed.nothing_sent and listed.operation_id == held.id
    assert listed.to_dict()["nothing_sent"] is True
    assert store.get(TENANT, held.id) == held  # a listing writes nothing

    report = scan(
        store, sandbox_provider, **window(), adopt_found=True, actor="alice", reason="failover"
    )

    (finding,) = report.findings
    assert (finding.verdict, finding.operation_id) == (Verdict.ADOPTED, held.id)
    assert finding.nothing_sent
    moved = store.get(TENANT, held.id)
    assert (moved.state, moved.needs_attention, moved.possibly_sent) == (
        State.SUCCEEDED,
        True,
        True,
    )
    assert moved.provider_reference == first.provider_reference
    assert moved.version == held.version + 1 and moved.completed_at is not None
    assert moved.resolution == "adopted" and moved.request is None
    adopted = store.events(TENANT, held.id)[-1]
    assert (adopted.kind, adopted.actor, adopted.from_state, adopted.to_state) == (
        "adopted",
        "alice",
        "in_progress",
        "succeeded",
    )
    assert adopted.detail is not None
    assert adopted.detail["evidence"]["object"]["id"] == first.provider_reference
    assert adopted.detail["released"]["operation_id"] == held.id
    assert adopted.detail["released"]["request"] == held.request

    retry = pay(executor, "k-released")
    assert retry.replayed and retry.state is State.SUCCEEDED
    assert (retry.operation_id, retry.provider_reference) == (held.id, first.provider_reference)
    with pytest.raises(IdempotencyKeyReused):
        pay(executor, "k-released", amount=9900)
    again = scan(store, sandbox_provider, **window())
    assert [f.verdict for f in again.findings] == [Verdict.EXPLAINED]
    assert len(sandbox.effects_for(original.downstream_key)) == 1
    assert len(sandbox.ledger()) == 1  # ONE effect, whatever came after


def test_a_pending_effect_moves_its_released_operation_to_outcome_unknown(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    sandbox.inject(Fault.PENDING)
    first = pay(executor, "k-released-pending")
    lose(store, first.operation_id)
    held = release(executor, sandbox, "k-released-pending")

    (finding,) = scan(
        store, sandbox_provider, **window(), adopt_found=True, actor="a", reason="r"
    ).findings

    assert finding.verdict is Verdict.ADOPTED and finding.operation_id == held.id
    moved = store.get(TENANT, held.id)
    assert moved.state is State.OUTCOME_UNKNOWN and moved.needs_attention
    assert moved.next_check_at is not None and moved.error_code is None
    assert moved.provider_reference == first.provider_reference
    sandbox.settle(first.provider_reference or "")
    Reconciler(store=store, providers=[sandbox_provider]).run_until_idle()
    assert store.get(TENANT, held.id).state is State.SUCCEEDED
    assert len(sandbox.ledger()) == 1


def test_a_retry_that_takes_the_released_operation_over_first_wins_by_its_version(
    store: Store,
    executor: Executor,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = pay(executor, "k-fence")
    lose(store, first.operation_id)
    held = release(executor, sandbox, "k-fence")
    (finding,) = scan(store, sandbox_provider, **window()).findings
    assert finding.nothing_sent and finding.adoptable
    moves = []
    real = unexplained.adopt_released

    def client_first(*args: Any, **kwargs: Any) -> OperationRecord:
        # Between the adoption's read and its write, the client comes back: it takes the
        # released operation over and the acquirer answers with the first effect.
        moves.append(pay(executor, "k-fence"))
        return real(*args, **kwargs)

    monkeypatch.setattr(unexplained, "adopt_released", client_first)

    ended = adopt(store, finding, actor="alice", reason="lost claim")

    (retry,) = moves
    assert retry.state is State.SUCCEEDED and retry.operation_id == held.id
    assert retry.provider_reference == first.provider_reference
    # The fence refused the stale write; judged again, the retry's outcome explains it.
    assert (ended.verdict, ended.operation_id, ended.explained_by) == (
        Verdict.EXPLAINED,
        held.id,
        "namespace",
    )
    (only,) = namespace_ops(store, "k-fence")
    assert only.state is State.SUCCEEDED and not only.needs_attention
    assert "adopted" not in [e.kind for e in store.events(TENANT, only.id)]
    assert len(sandbox.ledger()) == 1


def test_a_released_operation_of_other_fields_is_listed_never_adopted(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    first = pay(executor, "k-other-fields")
    lose(store, first.operation_id)
    sandbox.inject(Fault.RATE_LIMIT, times=RetryPolicy().max_attempts)
    with pytest.raises(ProviderUnavailable):
        pay(executor, "k-other-fields", amount=9900)  # another request under the key

    report = scan(store, sandbox_provider, **window(), adopt_found=True, actor="a", reason="r")

    (finding,) = report.findings
    assert finding.verdict is Verdict.UNEXPLAINED and finding.nothing_sent
    assert "other fields" in (finding.refusal or "")
    (only,) = namespace_ops(store, "k-other-fields")
    assert only.released and not only.needs_attention


# -- one bad effect does not stop the scan -------------------------------------------------


def test_a_malformed_tag_is_reported_and_the_scan_goes_on(
    store: Store, executor: Executor, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    lost = pay(executor, "k-good")
    lose(store, lost.operation_id)
    fingerprint = "ab" * 32
    quote_opened = {  # a key the store's canonical form refuses (it opens a quote)
        "payorch_ref": namespace_ref(TENANT, "payment.create", '"k-bad'),
        "payorch_tenant_id": TENANT,
        "payorch_operation": "payment.create",
        "payorch_idempotency_key": '"k-bad',
        "payorch_fingerprint": fingerprint,
    }
    bad_quote = post_with(sandbox, quote_opened)
    bad_tenant = post_with(sandbox, {**quote_opened, "payorch_tenant_id": "bad tenant"})
    bad_ref = post_with(
        sandbox, {**quote_opened, "payorch_idempotency_key": "k-x", "payorch_ref": "zz"}
    )

    report = scan(store, sandbox_provider, **window(), adopt_found=True, actor="a", reason="r")

    found = by_reference(report.findings)
    assert found[lost.provider_reference or ""].verdict is Verdict.ADOPTED
    for bad in (bad_quote, bad_tenant, bad_ref):
        assert found[bad].verdict is Verdict.UNEXPLAINED
        assert (found[bad].refusal or "").startswith("its tags are malformed"), found[bad]
    assert "quote" in (found[bad_quote].refusal or "")
    assert report.counts()["not_adoptable"] == 3
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar_one() == 1
    with pytest.raises(InvalidRequest, match="cannot be adopted"):
        adopt(store, found[bad_quote], actor="a", reason="r")
    assert len(sandbox.ledger()) == 4


def test_an_effect_whose_lookup_fails_is_reported_and_the_scan_goes_on(
    store: Store,
    executor: Executor,
    sandbox_provider: SandboxProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = pay(executor, "k-one"), pay(executor, "k-two")
    lose(store, first.operation_id)
    lose(store, second.operation_id)
    real = store.get_by_namespace

    def refusing(tenant_id: str, operation: str, key: str) -> OperationRecord:
        if key == "k-one":
            raise InvalidRequest("refused by the store")
        return real(tenant_id, operation, key)

    monkeypatch.setattr(store, "get_by_namespace", refusing)

    report = scan(store, sandbox_provider, **window(), adopt_found=True, actor="a", reason="r")

    found = by_reference(report.findings)
    assert found[first.provider_reference or ""].verdict is Verdict.UNEXPLAINED
    assert "could not be judged: refused by the store" in (
        found[first.provider_reference or ""].refusal or ""
    )
    assert found[second.provider_reference or ""].verdict is Verdict.ADOPTED


# -- an installation's key scope -----------------------------------------------------------


def test_a_scoped_installation_adopts_its_own_effects_and_skips_other_scopes(
    store: Store,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours = make_executor(store, sandbox_provider, key_scope="eu-1")
    theirs = make_executor(store, sandbox_provider, key_scope="us-1")
    unscoped = make_executor(store, sandbox_provider, key_scope="")
    # One account, three installations, the same tenant and key: three namespaces there.
    mine = pay(ours, "k-shared")
    original = store.get(TENANT, mine.operation_id)
    lose(store, mine.operation_id)
    for other in (theirs, unscoped):  # their rows are in their own databases, not here
        lose(store, pay(other, "k-shared").operation_id)
    assert len(sandbox.ledger()) == 3

    monkeypatch.setenv("PAYORCH_KEY_SCOPE", "eu-1")  # the installation's, as executors read it
    listed = scan(store, sandbox_provider, **window())
    assert listed.listed == 3 and listed.not_ours == 2 and listed.counts()["other_scope"] == 2
    (finding,) = listed.findings
    assert finding.effect.provider_reference == mine.provider_reference and finding.adoptable
    reasons = sorted(s.reason for s in listed.skipped)
    assert "made under another key scope" in reasons[0]
    assert "made under no key scope" in reasons[1]
    assert all("key scope 'eu-1'" in r for r in reasons)
    assert listed.skipped[0].to_dict()["reference"] in {e["id"] for e in sandbox.ledger()}
    with pytest.raises(InvalidRequest, match="not ours"):
        explain(store, "sandbox", listed.skipped[0].effect)
    monkeypatch.delenv("PAYORCH_KEY_SCOPE")

    # Unscoped, the same account: the unscoped effect is this installation's instead.
    unscoped_view = scan(store, sandbox_provider, **window())
    assert len(unscoped_view.findings) == 1 and unscoped_view.not_ours == 2

    report = scan(
        store,
        sandbox_provider,
        **window(),
        adopt_found=True,
        actor="alice",
        reason="lost",
        key_scope="eu-1",
    )

    (adopted,) = [f for f in report.findings if f.verdict is Verdict.ADOPTED]
    assert len(report.skipped) == 2
    record = store.get(TENANT, adopted.operation_id or "")
    assert record.downstream_key == original.downstream_key  # derived under the scope
    assert record.provider_reference == mine.provider_reference
    retry = pay(ours, "k-shared")
    assert retry.replayed and retry.operation_id == record.id
    assert len(sandbox.ledger()) == 3


def test_the_key_scope_comes_from_the_environment_and_is_checked(
    store: Store, sandbox_provider: SandboxProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    scoped_ref = namespace_ref(TENANT, "payment.create", "k-1", "eu-1")
    tagged = effect(
        payorch_ref=scoped_ref,
        payorch_tenant_id=TENANT,
        payorch_operation="payment.create",
        payorch_idempotency_key="k-1",
        payorch_fingerprint="ab" * 32,
    )
    assert not_ours(tagged, key_scope="eu-1") is None
    assert "another key scope" in (not_ours(tagged, key_scope="us-1") or "")
    assert "no key scope (PAYORCH_KEY_SCOPE unset)" in (not_ours(tagged) or "")
    assert "not its namespace's" in (adoption_refusal(tagged) or "")
    assert adoption_refusal(tagged, key_scope="eu-1") is None
    monkeypatch.setenv("PAYORCH_KEY_SCOPE", "eu-1")
    assert not_ours(tagged) is None and adoption_refusal(tagged) is None
    watch = UnexplainedWatch(
        store=store, providers=[sandbox_provider], every=timedelta(1), window=timedelta(1)
    )
    assert watch.key_scope == "eu-1"
    monkeypatch.setenv("PAYORCH_KEY_SCOPE", "not ok")
    with pytest.raises(ConfigurationError):
        UnexplainedWatch(
            store=store, providers=[sandbox_provider], every=timedelta(1), window=timedelta(1)
        )
    with pytest.raises(ConfigurationError):
        scan(store, sandbox_provider, **window())


def _submit_tagged(
    sandbox_provider: SandboxProvider,
    *,
    key: str,
    downstream: str,
    fingerprint: str = "",
) -> str:
    """An effect made as payorch once made it (no fingerprint tag), straight at the sandbox."""
    answer = sandbox_provider.submit(
        SubmitRequest(
            tenant_id=TENANT,
            operation="payment.create",
            operation_id=str(uuid.uuid4()),
            downstream_key=downstream,
            payload=PAYMENT,
            idempotency_key=key,
            fingerprint=fingerprint,
        )
    )
    assert answer.kind is AnswerKind.SUCCEEDED and answer.provider_reference
    return answer.provider_reference


def test_legacy_and_fingerprintless_effects_are_listed_never_adopted(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    # Tagged as payorch's Stripe requests were before keys came from the namespace (the
    # sandbox adapter's own earliest requests carried other, unprefixed metadata).
    legacy = post_with(
        sandbox, {"payorch_operation_id": str(uuid.uuid4()), "payorch_tenant_id": TENANT}
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
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    prepared = REGISTRY.prepare(
        tenant_id=TENANT, operation="payment.create", idempotency_key="k-leg", request=PAYMENT
    )
    record = store.claim(prepared.new, owner="w", lease=timedelta(minutes=1)).operation
    # Sent before keys came from the namespace: key and metadata name the operation id.
    reference = post_with(
        sandbox,
        {"payorch_operation_id": record.id, "payorch_tenant_id": TENANT},
        key=f"payorch:{record.id}:submit",
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
    quoted_key = '"k-1"'  # sent before keys were stored bare: its key came from this form
    quoted = {
        **tags,
        "payorch_idempotency_key": quoted_key,
        "payorch_ref": namespace_ref(TENANT, "payment.create", quoted_key),
    }
    assert "quoted form" in (adoption_refusal(effect(**quoted)) or "")
    assert "malformed" in (adoption_refusal(effect(**{**tags, "payorch_tenant_id": "a b"})) or "")


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
    router.get("/v1/refunds").mock(return_value=page())
    with pytest.raises(ProviderListingFailed) as bounded:
        list(stripe.list_effects(**window()))
    assert bounded.value.code == "too_many_pages"
    assert "/v1/payment_intents created" in bounded.value.message  # what was left unread


def stripe_lists(objects: list[dict[str, Any]]) -> Any:
    """Stripe's list endpoint over ``objects``: the created range, newest first, pages of
    ``limit`` after ``starting_after``, and ``has_more``."""

    def handler(request: httpx.Request) -> httpx.Response:
        params = request.url.params
        lo, hi = int(params["created[gte]"]), int(params["created[lte]"])
        chosen = sorted(
            (o for o in objects if lo <= o["created"] <= hi),
            key=lambda o: (-o["created"], o["id"]),
        )
        after = params.get("starting_after")
        if after is not None:
            chosen = chosen[[o["id"] for o in chosen].index(after) + 1 :]
        limit = int(params["limit"])
        return page(*chosen[:limit], has_more=len(chosen) > limit)

    return handler


def test_stripe_lists_a_busy_window_in_slices(
    stripe: StripeProvider, router: respx.Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stripe_listing, "MAX_LIST_PAGES", 2)  # 200 objects a slice
    day = datetime(2024, 5, 1, tzinfo=UTC)
    start = int(day.timestamp())
    made = [{**intent(f"pi_{i}", **OURS), "created": start + (i * 37) % 86400} for i in range(900)]
    made.append(intent("pi_theirs", order="7") | {"created": start + 5})
    intents = router.get("/v1/payment_intents").mock(side_effect=stripe_lists(made))
    router.get("/v1/refunds").mock(side_effect=stripe_lists([]))

    listed = [e.provider_reference for e in stripe.list_effects(day, day + timedelta(days=1))]

    assert sorted(listed) == sorted(f"pi_{i}" for i in range(900))  # each once, all of them
    ranges = {
        (c.request.url.params["created[gte]"], c.request.url.params["created[lte]"])
        for c in intents.calls
    }
    assert len(ranges) > 1  # the window was split
    assert intents.call_count <= stripe_listing.MAX_LIST_SLICES * 2


def test_stripe_names_what_one_busy_second_left_unread_and_lists_the_rest(
    stripe: StripeProvider, router: respx.Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stripe_listing, "MAX_LIST_PAGES", 2)
    day = datetime(2024, 5, 1, tzinfo=UTC)
    busy = int(day.timestamp()) + 3600
    crowded = [{**intent(f"pi_c{i}", **OURS), "created": busy} for i in range(250)]
    spread = [{**intent(f"pi_s{i}", **OURS), "created": busy - 1000 + i * 7} for i in range(50)]
    router.get("/v1/payment_intents").mock(side_effect=stripe_lists(crowded + spread))
    refund = {**intent("re_1", **OURS), "object": "refund", "status": "succeeded"}
    router.get("/v1/refunds").mock(side_effect=stripe_lists([{**refund, "created": busy}]))

    listed: list[str] = []
    with pytest.raises(ProviderListingFailed) as failed:
        for listed_effect in stripe.list_effects(day, day + timedelta(days=1)):
            listed.append(listed_effect.provider_reference)

    assert failed.value.code == "too_many_pages"
    assert "/v1/payment_intents created 2024-05-01T01:00:00Z to 2024-05-01T01:00:00Z" in (
        failed.value.message
    )
    assert {f"pi_s{i}" for i in range(50)} <= set(listed)  # the rest of the window
    assert "re_1" in listed  # and the other kind of object
    assert len(listed) == len(set(listed))


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


def test_the_daemon_look_judges_under_the_installation_key_scope(
    store: Store, sandbox_provider: SandboxProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = pay(make_executor(store, sandbox_provider, key_scope="eu-1"), "k-look")
    lose(store, mine.operation_id)
    lose(store, pay(make_executor(store, sandbox_provider, key_scope=""), "k-look").operation_id)
    monkeypatch.setenv("PAYORCH_KEY_SCOPE", "eu-1")  # as the daemon's process has it
    rec = Reconciler(store=store, providers=[sandbox_provider], owner="reconciler:test")
    watch = unexplained_watch(rec, Settings(unexplained_every_seconds=60, unexplained_adopt=True))
    assert watch is not None and watch.key_scope == "eu-1"

    (report,) = watch.run()

    assert report.counts()["other_scope"] == 1 and report.counts()["adopted"] == 1
    (adopted,) = namespace_ops(store, "k-look")
    assert adopted.provider_reference == mine.provider_reference and adopted.needs_attention


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
