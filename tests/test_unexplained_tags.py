"""Whose effects the unexplained look may adopt: key scopes, legacy and disagreeing tags."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from unexplained_helpers import (
    PAYMENT,
    REGISTRY,
    TENANT,
    by_reference,
    lose,
    make_executor,
    pay,
    post_with,
    window,
)

from payorch.core import downstream_key, namespace_ref
from payorch.errors import ConfigurationError, InvalidRequest
from payorch.provider import (
    TAG_FINGERPRINT,
    AnswerKind,
    ProviderEffect,
    SubmitRequest,
    provider_tags,
)
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._unexplained import (
    Verdict,
    adopt,
    adoption_refusal,
    explain,
    not_ours,
    scan,
)
from payorch.reconciling._watch import UnexplainedWatch
from payorch.storage._store import Store
from payorch.storage._tables import operations

# The installation's key scope is the environment's: none unless a test sets one.
pytestmark = pytest.mark.usefixtures("no_key_scope")


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
