"""The CLI's ``effects unexplained``: listing and adopting lost charges at the sandbox."""

from __future__ import annotations

import json

import httpx
import pytest
from cli_helpers import one_error_line, run, snapshot
from unexplained_helpers import lose, make_executor, pay

from payorch.core import State, namespace_ref
from payorch.errors import ProviderUnavailable
from payorch.execution._executor import RetryPolicy
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox._faults import Fault
from payorch.records import OperationRecord
from payorch.storage._store import Store

# -- effects unexplained -----------------------------------------------------------------


def _lost_charge(
    store: Store, sandbox_provider: SandboxProvider, key: str, key_scope: str = ""
) -> OperationRecord:
    """A payment made at the sandbox whose claim a failover then lost (its rows deleted)."""
    outcome = pay(make_executor(store, sandbox_provider, key_scope=key_scope), key)
    record = store.get("shop-a", outcome.operation_id)
    lose(store, record.id)
    return record


def test_effects_unexplained_lists_then_adopts_at_the_sandbox(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    lost = _lost_charge(store, sandbox_provider, "k-lost-claim")
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h"]

    listing = run(db_url, *args, "--json", env=env)
    assert listing.exit_code == 0, listing.output
    report = json.loads(listing.stdout)
    assert report["counts"]["unexplained"] == 1 and report["counts"]["adopted"] == 0
    (finding,) = report["findings"]
    assert finding["adoptable"] and finding["effect"]["tags"]["payorch_idempotency_key"] == (
        "k-lost-claim"
    )
    assert snapshot(store) == ([], 0)  # listing writes nothing

    adopted = run(
        db_url, *args, "--adopt", "--actor", "alice", "--reason", "failover", "--yes", env=env
    )
    assert adopted.exit_code == 0, adopted.output
    assert "1 adopted" in adopted.stdout
    record = store.get_by_namespace("shop-a", "payment.create", "k-lost-claim")
    assert record.state is State.SUCCEEDED and record.needs_attention
    assert record.downstream_key == lost.downstream_key
    (event,) = store.events("shop-a", record.id)
    assert (event.kind, event.actor) == ("adopted", "alice")
    assert f"adopted as {record.id}" in adopted.stdout

    again = run(db_url, *args, env=env)
    assert again.exit_code == 0
    assert "1 explained, 0 unexplained" in again.stdout
    assert len(sandbox.effects_for(lost.downstream_key)) == 1


def test_effects_unexplained_adopts_what_a_released_operation_says_was_never_sent(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    lost = _lost_charge(store, sandbox_provider, "k-released")
    # The client's retry re-creates the claim while the acquirer refuses every attempt.
    sandbox.inject(Fault.RATE_LIMIT, times=RetryPolicy().max_attempts)
    with pytest.raises(ProviderUnavailable) as caught:
        pay(make_executor(store, sandbox_provider, key_scope=""), "k-released")
    held = store.get("shop-a", caught.value.operation_id or "")
    assert held.released
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h"]

    listing = run(db_url, *args, "--json", env=env)
    assert listing.exit_code == 0, listing.output
    (finding,) = json.loads(listing.stdout)["findings"]
    assert finding["verdict"] == "unexplained" and finding["adoptable"]
    assert finding["nothing_sent"] and finding["operation_id"] == held.id
    table = run(db_url, *args, env=env)
    assert f"unexplained (its operation says nothing was sent: {held.id}), adoptable" in (
        table.stdout
    )

    adopted = run(db_url, *args, "--adopt", "--actor", "alice", "--reason", "r", "--yes", env=env)
    assert adopted.exit_code == 0, adopted.output
    assert f"adopted as {held.id}" in adopted.stdout and "1 adopted" in adopted.stdout
    record = store.get("shop-a", held.id)
    assert record.state is State.SUCCEEDED and record.needs_attention and record.possibly_sent
    assert record.provider_reference is not None
    assert store.events("shop-a", held.id)[-1].kind == "adopted"
    retry = pay(make_executor(store, sandbox_provider, key_scope=""), "k-released")
    assert retry.replayed and retry.operation_id == held.id
    assert len(sandbox.effects_for(lost.downstream_key)) == 1
    assert len(sandbox.ledger()) == 1


def test_effects_unexplained_reports_a_malformed_tag_and_adopts_the_rest(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    _lost_charge(store, sandbox_provider, "k-good")
    reply = httpx.post(
        f"{sandbox.url}/v1/operations/payment.create",
        json={
            "amount": 100,
            "currency": "EUR",
            "metadata": {
                "payorch_ref": namespace_ref("shop-a", "payment.create", '"k-bad'),
                "payorch_tenant_id": "shop-a",
                "payorch_operation": "payment.create",
                "payorch_idempotency_key": '"k-bad',  # opens a quote: no key of the store's
                "payorch_fingerprint": "ab" * 32,
            },
        },
        headers={"Idempotency-Key": "payorch:bad:submit"},
    )
    assert reply.status_code == 200
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h"]

    adopted = run(db_url, *args, "--adopt", "--actor", "a", "--reason", "r", "--yes", env=env)

    assert adopted.exit_code == 0, adopted.output
    assert "1 adopted" in adopted.stdout and "(1 not adoptable)" in adopted.stdout
    assert "not adoptable: its tags are malformed" in adopted.stdout
    record = store.get_by_namespace("shop-a", "payment.create", "k-good")
    assert record.state is State.SUCCEEDED and record.needs_attention


def test_effects_unexplained_skips_effects_of_another_key_scope(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    mine = _lost_charge(store, sandbox_provider, "k-scoped", key_scope="eu-1")
    theirs = _lost_charge(store, sandbox_provider, "k-scoped")  # an unscoped installation's
    env = {"PAYORCH_SANDBOX_URL": sandbox.url, "PAYORCH_KEY_SCOPE": "eu-1"}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h"]

    listing = run(db_url, *args, "--json", env=env)
    assert listing.exit_code == 0, listing.output
    report = json.loads(listing.stdout)
    assert report["counts"]["not_ours"] == 1 and report["counts"]["other_scope"] == 1
    (skipped,) = report["skipped"]
    assert "made under no key scope" in skipped["reason"]
    assert skipped["tags"]["payorch_ref"] == theirs.downstream_key.split(":")[1]
    (finding,) = report["findings"]
    assert finding["effect"]["tags"]["payorch_ref"] == mine.downstream_key.split(":")[1]

    adopted = run(db_url, *args, "--adopt", "--actor", "a", "--reason", "r", "--yes", env=env)
    assert adopted.exit_code == 0, adopted.output
    assert "1 not payorch's (1 under another key scope)" in adopted.stdout
    record = store.get_by_namespace("shop-a", "payment.create", "k-scoped")
    assert record.downstream_key == mine.downstream_key and record.needs_attention
    bad = run(db_url, *args, env={**env, "PAYORCH_KEY_SCOPE": "not ok"})
    assert bad.exit_code == 1 and "PAYORCH_KEY_SCOPE" in one_error_line(bad)


def test_effects_unexplained_adopt_asks_first_and_needs_an_audit_trail(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    _lost_charge(store, sandbox_provider, "k-ask")
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h", "--adopt"]

    no_actor = run(db_url, *args, "--reason", "r", env=env)
    assert no_actor.exit_code == 2
    assert "--adopt needs --actor and --reason" in one_error_line(no_actor)
    declined = run(db_url, *args, "--actor", "a", "--reason", "r", input="n\n", env=env)
    assert declined.exit_code == 1
    assert "nothing adopted" in declined.stderr
    assert snapshot(store) == ([], 0)
    bad_since = run(db_url, "effects", "unexplained", "--provider", "sandbox", "--since", "soon")
    assert bad_since.exit_code == 2 and "neither an ISO 8601 time" in one_error_line(bad_since)


def test_effects_unexplained_on_a_provider_that_cannot_list_is_one_line(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SubmitsOnly:  # an adapter of the embedding app's, without list_effects
        name = "acquirer"

    monkeypatch.setattr("payorch.cli._effects.build_providers", lambda *_: [SubmitsOnly()])
    result = run(db_url, "effects unexplained --provider acquirer --since 2024-05-01T00:00Z")
    assert result.exit_code == 1
    assert "'acquirer' cannot list its effects" in one_error_line(result)
    unknown = run(db_url, "effects unexplained --provider nope --since 24h")
    assert unknown.exit_code == 1
    assert "no provider named 'nope'" in one_error_line(unknown)


def test_effects_unexplained_when_the_provider_is_down_is_one_line(db_url: str) -> None:
    env = {"PAYORCH_SANDBOX_URL": "http://127.0.0.1:9"}
    result = run(db_url, "effects unexplained --provider sandbox --since 1h", env=env)
    assert result.exit_code == 1
    assert "listing effects failed (ConnectError" in one_error_line(result)
