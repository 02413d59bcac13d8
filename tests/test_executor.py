"""execute() over real HTTP to the sandbox, on PostgreSQL and SQLite.

For every fault the caller's result, the stored state and the sandbox ledger agree, and the
ledger never holds two money effects for one operation.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
import workers
from conftest import FAST_TIMEOUT, RecordingSleep, effects_of

from payorch.core import State
from payorch.errors import (
    ConfigurationError,
    IdempotencyKeyReused,
    ProviderUnavailable,
    RequestValidationFailed,
    UnknownProvider,
)
from payorch.execution._executor import Executor, RetryPolicy
from payorch.operations import default_registry
from payorch.provider import Answer, SubmitRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._store import Store
from payorch.storage._tables import operations

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
MONEY = ("succeeded", "processing")


def money_effects(sandbox: SandboxServer, store: Store, operation_id: str) -> list[dict[str, Any]]:
    return [e for e in effects_of(sandbox, store, "shop", operation_id) if e["status"] in MONEY]


def run(executor: Executor, key: str = "order-1", **request: Any) -> Any:
    return executor.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={**PAYMENT, **request},
    )


def test_success_is_stored_and_replayed_with_one_effect(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    first = run(executor)
    assert first.state is State.SUCCEEDED and not first.replayed
    assert first.http_status == 200
    assert first.provider_reference and first.provider_reference.startswith("sbx_")
    again = run(executor)
    assert again.replayed and again.operation_id == first.operation_id
    assert again.provider_reference == first.provider_reference
    assert len(money_effects(sandbox, store, first.operation_id)) == 1
    assert len(sandbox.ledger()) == 1
    # The replay is counted on the operation, not logged: the log holds state changes.
    kinds = [e.kind for e in store.events("shop", first.operation_id)]
    assert kinds == ["claimed", "provider_answer"]
    with store.engine.connect() as conn:
        replays = conn.execute(
            sa.select(operations.c.replays).where(operations.c.id == first.operation_id)
        ).scalar_one()
    assert replays == 1
    answer = store.events("shop", first.operation_id)[1]
    assert answer.detail is not None
    assert answer.detail["possibly_sent"] is True and "duration_ms" in answer.detail


@pytest.mark.parametrize(
    ("fault", "state", "effects", "http_status"),
    [
        ("latency", State.SUCCEEDED, 1, 200),
        ("decline", State.FAILED_FINAL, 0, 402),
        ("error_500_before", State.OUTCOME_UNKNOWN, 0, 202),
        ("error_500_after", State.OUTCOME_UNKNOWN, 1, 202),
        ("drop_after", State.OUTCOME_UNKNOWN, 1, 202),
        ("reset_after", State.OUTCOME_UNKNOWN, 1, 202),
        ("pending", State.OUTCOME_UNKNOWN, 1, 202),
        ("rate_limit", State.SUCCEEDED, 1, 200),
    ],
)
def test_each_fault_caller_store_and_ledger_agree(
    executor: Executor,
    sandbox: SandboxServer,
    store: Store,
    fault: str,
    state: State,
    effects: int,
    http_status: int,
) -> None:
    sandbox.inject(fault)
    outcome = run(executor)
    stored = store.get("shop", outcome.operation_id)
    assert outcome.state is state is stored.state
    assert outcome.http_status == http_status
    assert len(money_effects(sandbox, store, outcome.operation_id)) == effects
    # The same key again never adds an effect, whatever the first attempt went through.
    run(executor)
    assert len(money_effects(sandbox, store, outcome.operation_id)) == effects
    assert stored.possibly_sent is True


def test_dropped_response_is_unknown_and_a_client_retry_never_charges_twice(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    sandbox.inject("drop_after")
    first = run(executor)
    assert first.state is State.OUTCOME_UNKNOWN and first.http_status == 202
    for _ in range(3):
        retry = run(executor)
        assert retry.operation_id == first.operation_id
        assert retry.state is State.OUTCOME_UNKNOWN and not retry.replayed
    assert len(money_effects(sandbox, store, first.operation_id)) == 1
    assert len(sandbox.ledger()) == 1
    evidence = store.events("shop", first.operation_id)[-1].detail
    assert evidence is not None and evidence["kind"] == "ambiguous"


def test_decline_is_stored_and_replayed_as_the_same_failure(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    first = run(executor, payment_method="pm_card_declined")
    again = run(executor, payment_method="pm_card_declined")
    assert first.state is State.FAILED_FINAL and again.replayed
    assert (again.http_status, again.error_code, again.response) == (
        first.http_status,
        first.error_code,
        first.response,
    )
    assert first.error_code == "generic_decline"
    assert len(effects_of(sandbox, store, "shop", first.operation_id)) == 1
    assert money_effects(sandbox, store, first.operation_id) == []


def test_rate_limit_is_retried_with_the_same_key_then_succeeds(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    sandbox.inject("rate_limit", times=2)
    outcome = run(executor)
    assert outcome.state is State.SUCCEEDED
    record = store.get("shop", outcome.operation_id)
    assert record.attempts == 3
    attempts = [e for e in store.events("shop", outcome.operation_id) if e.kind == "attempt"]
    assert [a.detail["kind"] for a in attempts if a.detail] == ["not_sent", "not_sent"]
    assert {a.detail["downstream_key"] for a in attempts if a.detail} == {record.downstream_key}
    sleep = executor._sleep
    assert isinstance(sleep, RecordingSleep)
    assert len(sleep.delays) == 2 and all(d >= 1.0 for d in sleep.delays)  # Retry-After: 1
    assert len(money_effects(sandbox, store, outcome.operation_id)) == 1


def test_not_sent_on_every_attempt_is_released_with_no_effect_and_the_same_key_runs_again(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    sandbox.inject("rate_limit", times=RetryPolicy().max_attempts)  # every inline attempt
    with pytest.raises(ProviderUnavailable) as caught:
        run(executor)
    err = caught.value
    assert err.http_status == 503 and err.code == "rate_limited" and err.operation_id
    record = store.get("shop", err.operation_id)
    # Nothing is stored as the key's answer: released, leased by nobody, nothing sent.
    assert record.released and record.state is State.IN_PROGRESS
    assert record.lease_owner is None and record.possibly_sent is False
    assert record.response is not None and record.response["status"] == "not_sent"
    assert err.retry_after >= 1.0  # the sandbox's Retry-After travels to the caller
    assert sandbox.ledger() == []

    outcome = run(executor)  # the same key runs again, under the same downstream key
    assert outcome.state is State.SUCCEEDED and not outcome.replayed
    assert outcome.operation_id == err.operation_id
    assert len(money_effects(sandbox, store, outcome.operation_id)) == 1
    assert len(sandbox.ledger()) == 1


def test_connect_error_is_not_sent(store: Store) -> None:
    closed = SandboxProvider(base_url="http://127.0.0.1:9", timeout=FAST_TIMEOUT)
    ex = Executor(
        store=store,
        providers=[closed],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        retry=RetryPolicy(max_attempts=2),
        sleep=RecordingSleep(),
    )
    with closed:
        with pytest.raises(ProviderUnavailable) as caught:
            run(ex)
        first = store.get("shop", caught.value.operation_id)
        assert first.released and first.possibly_sent is False and first.lease_owner is None
        # Still unreachable: the same key runs the same operation again, and is released again.
        with pytest.raises(ProviderUnavailable) as again:
            run(ex)
    assert again.value.operation_id == first.id
    second = store.get("shop", first.id)
    assert second.released and second.attempts > first.attempts
    assert second.downstream_key == first.downstream_key


def test_a_worker_that_lost_its_lease_records_its_answer_as_evidence_only(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    class Overtaken:
        """Submits for real, but meanwhile the reconciler has taken the operation over."""

        name = "sandbox"
        idempotency_window = sandbox_provider.idempotency_window
        max_call_duration = sandbox_provider.max_call_duration

        def submit(self, request: SubmitRequest) -> Answer:
            answer = sandbox_provider.submit(request)
            current = store.get(request.tenant_id, request.operation_id)
            store.transition(
                current, State.OUTCOME_UNKNOWN, kind="status_query", actor="reconciler"
            )
            return answer

        def query_status(self, query: Any) -> Answer:
            raise NotImplementedError

        def parse_webhook(self, headers: Any, body: bytes) -> Any:
            raise NotImplementedError

    ex = Executor(
        store=store,
        providers=[Overtaken()],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        sleep=RecordingSleep(),
        owner="slow-worker",
    )
    outcome = run(ex)
    assert outcome.state is State.OUTCOME_UNKNOWN  # what the reconciler decided stands
    events = store.events("shop", outcome.operation_id)
    assert events[-1].kind == "late_answer" and events[-1].actor == "slow-worker"
    assert events[-1].detail is not None and events[-1].detail["kind"] == "succeeded"
    assert len(money_effects(sandbox, store, outcome.operation_id)) == 1


def test_reused_key_with_changed_amount_executes_nothing(
    executor: Executor, sandbox: SandboxServer
) -> None:
    first = run(executor)
    with pytest.raises(IdempotencyKeyReused):
        run(executor, amount=9999)
    assert len(sandbox.ledger()) == 1
    assert sandbox.ledger()[0]["amount"] == first.response["provider_response"]["amount"]


def _count(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar_one())


def test_unknown_provider_and_invalid_request_store_nothing(
    executor: Executor, sandbox: SandboxServer, store: Store
) -> None:
    with pytest.raises(UnknownProvider):
        executor.execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key="k",
            request=PAYMENT,
            provider="acme",
        )
    with pytest.raises(RequestValidationFailed):
        run(executor, amount=12.5)
    assert _count(store) == 0
    assert sandbox.ledger() == []
    # The key was not reserved by the refused request.
    assert run(executor, key="k").state is State.SUCCEEDED


def test_a_lease_shorter_than_the_call_is_refused_at_start_up(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    with pytest.raises(ConfigurationError, match="lease"):
        Executor(store=store, providers=[sandbox_provider], lease=timedelta(seconds=2))


@pytest.mark.slow
def test_sigkill_after_commit_leaves_in_progress_and_one_effect(
    db_url: str, sandbox: SandboxServer, store: Store
) -> None:
    workers.run_until_killed(db_url, sandbox.url, "crash-1")
    record = store.get_by_namespace("shop", "payment.create", "crash-1")
    assert record.state is State.IN_PROGRESS
    assert record.lease_expires_at is not None and record.possibly_sent
    assert len(money_effects(sandbox, store, record.id)) == 1


def test_an_unparsable_answer_is_unknown_with_bounded_raw_evidence(store: Store) -> None:
    import httpx

    page = "<html>" + "x" * 10_000 + "</html>"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=page))
    with SandboxProvider(base_url="http://127.0.0.1:1", transport=transport) as odd:
        ex = Executor(
            store=store,
            providers=[odd],
            registry=default_registry("sandbox"),
            lease=timedelta(seconds=60),
            sleep=RecordingSleep(),
        )
        outcome = run(ex)
    assert outcome.state is State.OUTCOME_UNKNOWN
    evidence = store.events("shop", outcome.operation_id)[-1].detail
    assert evidence is not None and evidence["kind"] == "ambiguous"
    assert evidence["raw"].startswith("<html>") and len(evidence["raw"]) <= 4096
