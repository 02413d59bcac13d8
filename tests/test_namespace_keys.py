"""What crosses to the provider comes from the namespace; one key whatever its form; nothing
sent, nothing stored. Sync and async (the ``executor`` fixture), PostgreSQL and SQLite.

A claim lost in a database failover is re-created by the client's retry with a new operation
id: the provider must see the very same request under the very same key, and its own
idempotency answers it. Effects are counted at the sandbox.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from payorch import migrate
from payorch.core import (
    State,
    canonical_idempotency_key,
    downstream_key,
    is_namespace_key,
    namespace_ref,
    operation_id_from_downstream_key,
)
from payorch.errors import (
    ConfigurationError,
    IdempotencyKeyReused,
    InvalidIdempotencyKey,
    ProviderUnavailable,
)
from payorch.execution._executor import Executor, RetryPolicy
from payorch.execution._flights import Flights
from payorch.http import SAME_KEY, http_answer
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.provider import SubmitRequest, provider_tags
from payorch.providers.sandbox import SandboxServer
from payorch.reconciling._reconciler import Reconciler
from payorch.records import NewOperation
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}


def run(executor: Executor, key: str, **request: Any) -> Any:
    return executor.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={**PAYMENT, **request},
    )


def _posts(sandbox: SandboxServer) -> list[dict[str, Any]]:
    return [r for r in sandbox.requests() if r["method"] == "POST"]


def _lose(store: Store, operation_id: str) -> None:
    """What a promoted asynchronous replica does to a claim it never received."""
    with store.engine.begin() as conn:
        conn.execute(sa.delete(events).where(events.c.operation_id == operation_id))
        conn.execute(sa.delete(operations).where(operations.c.id == operation_id))


# -- pure ---------------------------------------------------------------------------------

names = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)


@given(tenant=names, operation=names, key=names, other=names)
def test_the_downstream_key_is_a_pure_function_of_the_namespace(
    tenant: str, operation: str, key: str, other: str
) -> None:
    ref = namespace_ref(tenant, operation, key)
    assert ref == namespace_ref(tenant, operation, key)
    assert len(downstream_key(ref)) <= 64  # what the strictest acquirers accept
    assert is_namespace_key(downstream_key(ref, "capture"))
    assert operation_id_from_downstream_key(downstream_key(ref)) is None
    if other != key:
        assert namespace_ref(tenant, operation, other) != ref
        assert namespace_ref(other, operation, key) != namespace_ref(tenant, operation, key) or (
            other == tenant
        )


def test_tags_name_the_namespace_and_never_the_operation_id() -> None:
    ref = namespace_ref("shop", "payment.create", "k1")
    common = {"tenant_id": "shop", "operation": "payment.create", "idempotency_key": "k1"}
    first = provider_tags(**common, operation_id="id-1", downstream_key=downstream_key(ref))
    again = provider_tags(**common, operation_id="id-2", downstream_key=downstream_key(ref))
    assert first == again
    assert "id-1" not in json.dumps(first)
    # An operation claimed before keys came from the namespace keeps what it first sent.
    legacy = provider_tags(**common, operation_id="id-1", downstream_key="payorch:id-1:submit")
    assert legacy == {"payorch_operation_id": "id-1", "payorch_tenant_id": "shop"}


@pytest.mark.parametrize(
    ("given_key", "key"),
    [('"abc-19"', "abc-19"), ("abc-19", "abc-19"), ('"a\\"b"', 'a"b'), ('"x\\\\y"', "x\\y")],
)
def test_the_sf_string_form_and_the_bare_token_are_one_key(given_key: str, key: str) -> None:
    assert canonical_idempotency_key(given_key) == key
    assert canonical_idempotency_key(canonical_idempotency_key(given_key)) == key


@pytest.mark.parametrize("bad", ['"abc', '"a" "b"', '"k";p=1', '"\\"k"', '""'])
def test_a_key_that_opens_a_quote_but_is_no_sf_string_is_refused(bad: str) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        canonical_idempotency_key(bad)


# -- a claim lost and re-created ------------------------------------------------------------


def test_a_lost_claim_re_created_by_the_retry_sends_the_same_request_and_charges_once(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    first = run(executor, "order-lost")
    assert first.state is State.SUCCEEDED
    _lose(store, first.operation_id)

    again = run(executor, "order-lost")
    assert again.operation_id != first.operation_id  # a new claim, a new id
    assert again.state is State.SUCCEEDED
    assert again.provider_reference == first.provider_reference  # the provider's replay
    assert len(sandbox.ledger()) == 1
    sent = _posts(sandbox)
    assert len(sent) == 2
    keys = {r["headers"]["idempotency-key"] for r in sent}
    assert keys == {store.get("shop", again.operation_id).downstream_key}
    assert sent[0]["body"] == sent[1]["body"]
    assert all(first.operation_id.encode() not in r["body"] for r in sent)


def test_a_lost_claim_with_a_changed_field_is_refused_by_the_provider_not_charged(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    first = run(executor, "order-lost-2")
    _lose(store, first.operation_id)
    again = run(executor, "order-lost-2", amount=999)
    # The provider holds another request under our key: unknown and flagged, never a charge.
    assert again.state is State.OUTCOME_UNKNOWN and again.needs_attention
    assert len(sandbox.ledger()) == 1


# -- one key whatever its form --------------------------------------------------------------


def test_execute_treats_the_quoted_and_the_bare_key_as_one(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    first = run(executor, '"abc-19"')
    again = run(executor, "abc-19")
    assert again.replayed and again.operation_id == first.operation_id
    assert store.get("shop", first.operation_id).idempotency_key == "abc-19"
    assert len(sandbox.ledger()) == 1


def test_execute_refuses_a_badly_quoted_key_and_writes_nothing(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        run(executor, '"abc-19')
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar() == 0
    assert sandbox.requests() == []


# -- nothing sent, nothing spent ------------------------------------------------------------


def test_nothing_sent_is_not_stored_and_the_same_key_runs_again(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    sandbox.inject("rate_limit", times=RetryPolicy().max_attempts)  # every inline attempt
    with pytest.raises(ProviderUnavailable) as caught:
        run(executor, "order-429")
    err = caught.value
    assert err.http_status == 503 and err.operation_id is not None
    answer = http_answer(err)
    assert answer.status == 503 and answer.body["retry"] == SAME_KEY
    assert "Retry-After" in answer.headers
    record = store.get("shop", err.operation_id)
    assert record.released and record.state is State.IN_PROGRESS and not record.possibly_sent
    assert sandbox.ledger() == []
    tried = {r["headers"]["idempotency-key"] for r in _posts(sandbox)}

    # The fingerprint stays bound to the key: another amount is refused, nothing sent.
    with pytest.raises(IdempotencyKeyReused):
        run(executor, "order-429", amount=1)

    outcome = run(executor, "order-429")
    assert outcome.state is State.SUCCEEDED and not outcome.replayed
    assert outcome.operation_id == err.operation_id  # the same operation, run again
    assert {r["headers"]["idempotency-key"] for r in _posts(sandbox)} == tried
    assert len(sandbox.ledger()) == 1
    kinds = [e.kind for e in store.events("shop", outcome.operation_id)]
    assert kinds[0] == "claimed" and "not_sent" in kinds and "reclaimed" in kinds
    assert run(executor, "order-429").replayed


def test_an_abandoned_operation_is_released_not_failed(store: Store) -> None:
    executor_owner = "crashed-worker"
    new = NewOperation(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key="order-abandoned",
        fingerprint="f" * 64,
        provider="sandbox",
    )
    claim = store.claim(new, owner=executor_owner, lease=timedelta(seconds=30))
    assert not claim.operation.possibly_sent
    with store.engine.begin() as conn:  # the worker died before sending; its lease lapsed
        conn.execute(
            sa.update(operations)
            .where(operations.c.id == claim.operation.id)
            .values(
                lease_expires_at=claim.operation.created_at - timedelta(seconds=1),
                next_check_at=claim.operation.created_at - timedelta(seconds=1),
            )
        )
    Reconciler(store=store, providers=[]).run_until_idle()
    record = store.get("shop", claim.operation.id)
    assert record.released and record.state is State.IN_PROGRESS
    assert [e.kind for e in store.events("shop", record.id)][-1] == "abandoned"
    taken = store.claim(new, owner="next-request", lease=timedelta(seconds=30), possibly_sent=True)
    assert taken.created and taken.operation.id == record.id
    assert taken.operation.lease_owner == "next-request" and taken.operation.possibly_sent


def test_submit_request_tags_are_what_the_sandbox_receives(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    outcome = run(executor, "order-tags")
    record = store.get("shop", outcome.operation_id)
    expected = SubmitRequest(
        tenant_id="shop",
        operation="payment.create",
        operation_id="ignored",
        downstream_key=record.downstream_key,
        payload={},
        idempotency_key="order-tags",
        fingerprint=record.fingerprint,
    ).tags
    (effect,) = sandbox.ledger()
    assert {k: v for k, v in effect["metadata"].items() if k.startswith("payorch_")} == expected


def test_the_migration_unquotes_stored_keys_and_keeps_old_failures_closed(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    migrate.upgrade(url, "payorch_0002")
    engine = sa.create_engine(url)
    base = {
        "tenant_id": "shop",
        "operation": "payment.create",
        "fingerprint": "f" * 64,
        "state": "succeeded",
        "provider": "sandbox",
        "retention_seconds": 86400,
        "possibly_sent": True,
        "attempts": 1,
        "checks": 0,
        "needs_attention": False,
        "version": 2,
        "created_at": "2026-11-30 10:00:00.000000",
        "updated_at": "2026-11-30 10:00:01.000000",
    }

    def row(n: int, key: str, **values: Any) -> dict[str, Any]:
        op_id = f"018f0000-0000-7000-8000-00000000000{n}"
        return {
            **base,
            "id": op_id,
            "idempotency_key": key,
            "downstream_key": f"payorch:{op_id}:submit",
            **values,
        }

    rows = [
        row(1, '"abc-19"'),  # stored quoted by a service that passed the raw header
        row(2, '"dup"'),  # both forms already hold an operation: the old duplicate
        row(3, "dup"),
        row(4, '"not-sf'),  # a key that merely begins with a quote
        row(
            5,
            "k-old",
            state="failed_final",
            possibly_sent=False,
            error_code="provider_unavailable",
            response='{"status": "failed", "http_status": 503, "code": "provider_unavailable"}',
        ),
    ]
    with engine.begin() as conn:
        for values in rows:
            cols = ", ".join(values)
            marks = ", ".join(f":{k}" for k in values)
            conn.execute(
                sa.text(f"INSERT INTO payorch_operations ({cols}) VALUES ({marks})"), values
            )
    engine.dispose()
    migrate.upgrade(url)
    store = Store.from_url(url)
    try:
        first = store.get("shop", rows[0]["id"])
        assert first.idempotency_key == "abc-19"
        assert first.downstream_key == rows[0]["downstream_key"]  # what the provider saw
        assert store.get_by_namespace("shop", "payment.create", '"abc-19"').id == first.id
        assert store.get("shop", rows[1]["id"]).needs_attention
        assert store.get("shop", rows[1]["id"]).idempotency_key == '"dup"'
        assert store.get("shop", rows[3]["id"]).idempotency_key == '"not-sf'
        old = store.get("shop", rows[4]["id"])
        assert old.state is State.FAILED_FINAL  # stays closed: its client was told new_key
        answer = http_answer(Outcome.from_record(old, replayed=True))
        assert answer.status == 402 and "retry" not in answer.body
    finally:
        store.close()


# -- taking a released operation over ---------------------------------------------------------


def _released(store: Store, new: NewOperation) -> NewOperation:
    claim = store.claim(new, owner="first", lease=timedelta(seconds=30), possibly_sent=True)
    store.transition(
        claim.operation,
        State.IN_PROGRESS,
        kind="not_sent",
        actor="first",
        possibly_sent=False,
        response={"status": "not_sent", "code": "rate_limited", "retry_after": 2.0},
    )
    return new


def _new(**values: Any) -> NewOperation:
    fields: dict[str, Any] = {
        "tenant_id": "shop",
        "operation": "payment.create",
        "idempotency_key": "order-over",
        "fingerprint": "f" * 64,
        "provider": "sandbox",
        "request": {"amount": 5, "currency": "EUR", "description": "first"},
        **values,
    }
    return NewOperation(**fields)


def test_a_released_operation_is_not_taken_over_for_another_provider(store: Store) -> None:
    _released(store, _new())
    with pytest.raises(IdempotencyKeyReused) as caught:
        store.claim(_new(provider="other"), owner="second", lease=timedelta(seconds=30))
    assert "sandbox" in caught.value.message
    record = store.get_by_namespace("shop", "payment.create", "order-over")
    assert record.released and record.provider == "sandbox"


def test_a_take_over_stores_the_request_it_sends(store: Store) -> None:
    _released(store, _new())
    later = _new(request={"amount": 5, "currency": "EUR", "description": "second"})
    taken = store.claim(later, owner="second", lease=timedelta(seconds=30), possibly_sent=True)
    assert taken.created and taken.operation.lease_owner == "second"
    assert taken.operation.request == later.request
    assert taken.operation.possibly_sent and taken.operation.attempts == 2


def test_joiners_of_a_leader_that_found_the_provider_unavailable_get_its_answer(
    executor: Executor,
) -> None:
    flights = Flights()
    namespace = ("shop", "payment.create", "k")
    flight, leading = flights.lead_or_join(namespace, "f" * 64, may_join=True)
    joined, joining = flights.lead_or_join(namespace, "f" * 64, may_join=True)
    assert leading and not joining and joined is flight
    said = ProviderUnavailable("nothing sent", operation_id="op-1", retry_after=7.0, code="x")
    flights.land(namespace, flight, None, said)
    sync = getattr(executor, "_sync", executor)  # the async driver's sync core
    with pytest.raises(ProviderUnavailable) as caught:
        sync._join(flight, timedelta(seconds=5))
    assert caught.value is not said  # a copy per joiner
    assert (caught.value.operation_id, caught.value.retry_after, caught.value.code) == (
        "op-1",
        7.0,
        "x",
    )


# -- an installation's key scope --------------------------------------------------------------


def test_a_key_scope_sets_installations_apart_and_comes_from_the_environment(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = namespace_ref("shop", "payment.create", "k")
    assert namespace_ref("shop", "payment.create", "k", "eu-1") != plain
    assert namespace_ref("shop", "payment.create", "k", "eu-1") != namespace_ref(
        "shop", "payment.create", "k", "us-1"
    )
    monkeypatch.setenv("PAYORCH_KEY_SCOPE", "eu-1")
    ex = Executor(store=store, providers=[], registry=default_registry("sandbox"))
    assert ex.key_scope == "eu-1"
    assert Executor(store=store, providers=[], key_scope="").key_scope == ""
    monkeypatch.setenv("PAYORCH_KEY_SCOPE", "not ok")
    with pytest.raises(ConfigurationError):
        Executor(store=store, providers=[])


def test_scoped_executors_send_scoped_keys(
    store: Store, sandbox: SandboxServer, sandbox_provider: Any
) -> None:
    ex = Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        key_scope="eu-1",
    )
    outcome = run(ex, "order-scoped")
    record = store.get("shop", outcome.operation_id)
    ref = namespace_ref("shop", "payment.create", "order-scoped", "eu-1")
    assert record.downstream_key == downstream_key(ref)
    (effect,) = sandbox.ledger()
    assert effect["idempotency_key"] == record.downstream_key
    assert effect["metadata"]["payorch_ref"] == ref
