"""Effects no operation explains (issue 21, item 5): a charge whose claim was lost.

The sandbox acquirer runs on loopback and the store is real (SQLite and PostgreSQL). A lost
claim is what an asynchronous failover leaves: the effect at the provider, no row here.
Here: the look itself, adoption, released operations and effects that cannot be judged.
Whose effects may be adopted is in test_unexplained_tags.py, the adapters' listings in
test_unexplained_listing.py, the daemon's scheduled look in test_unexplained_watch.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from unexplained_helpers import (
    REGISTRY,
    TENANT,
    by_reference,
    lose,
    make_executor,
    namespace_ops,
    pay,
    post_untagged,
    post_with,
    window,
)

from payorch.core import State, namespace_ref
from payorch.errors import IdempotencyKeyReused, InvalidRequest, ProviderUnavailable
from payorch.execution._executor import Executor, RetryPolicy
from payorch.outcome import Outcome
from payorch.provider import AnswerKind
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox._faults import Fault
from payorch.reconciling import _unexplained as unexplained
from payorch.reconciling._reconciler import Reconciler
from payorch.reconciling._unexplained import Finding, Verdict, adopt, scan
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import operations

# The installation's key scope is the environment's: none unless a test sets one.
pytestmark = pytest.mark.usefixtures("no_key_scope")


@pytest.fixture
def executor(store: Store, sandbox_provider: SandboxProvider) -> Executor:
    return make_executor(store, sandbox_provider)


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
