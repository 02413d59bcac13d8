"""Answers that say what happened: problem types, 4xx for the caller's mistakes, 503s that
say when and with which key (always the same one), and a provider's 401/403 as "nothing
sent", never a decline."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
import respx
import sqlalchemy as sa
from conftest import RecordingSleep
from test_http_contract import every_error

from payorch import errors
from payorch.core import State
from payorch.errors import (
    ConfigurationError,
    IdempotencyKeyReused,
    OutcomeNotRecorded,
    ProviderUnavailable,
    RequestValidationFailed,
    StorageError,
    UnknownProvider,
)
from payorch.execution._executor import Executor
from payorch.http import http_answer
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.provider import AnswerKind, answer_from_http_status
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.stripe import StripeProvider
from payorch.storage._store import Store
from payorch.storage._tables import operations

PAYMENT = {"amount": 990, "currency": "EUR", "customer": "cus_3"}
STRIPE = "https://api.stripe.test"


def pay(executor: Executor, key: str, **extra: object) -> Outcome:
    return executor.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={**PAYMENT, **extra},
    )


def _count(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar_one())


def test_a_reused_key_and_a_refused_payload_are_told_apart(executor: Executor) -> None:
    pay(executor, "k")
    with pytest.raises(IdempotencyKeyReused) as reused:
        pay(executor, "k", amount=991)
    with pytest.raises(RequestValidationFailed) as invalid:
        pay(executor, "k2", amount="lots")
    a, b = http_answer(reused.value), http_answer(invalid.value)
    assert (a.status, b.status) == (422, 422)
    assert a.body["type"] == "urn:payorch:problem:idempotency-key-reused"
    assert b.body["type"] == "urn:payorch:problem:request-validation-failed"


def test_an_unknown_provider_from_the_caller_is_a_4xx_and_stores_nothing(
    executor: Executor, store: Store, sandbox: SandboxServer
) -> None:
    with pytest.raises(UnknownProvider) as info:
        executor.execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key="k",
            request=PAYMENT,
            provider="acme",
        )
    answer = http_answer(info.value)
    assert answer.status == 400
    assert answer.body["type"] == "urn:payorch:problem:unknown-provider"
    assert not isinstance(info.value, ConfigurationError)
    assert _count(store) == 0 and sandbox.ledger() == []


def test_a_default_provider_missing_from_the_executor_is_a_configuration_error(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    ex = Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("stripe"),  # every type defaults to a provider we lack
        lease=timedelta(seconds=30),
        sleep=RecordingSleep(),
    )
    with pytest.raises(ConfigurationError) as info:
        pay(ex, "k")
    assert http_answer(info.value).status == 500
    assert _count(store) == 0


@pytest.mark.parametrize(
    "err",
    [
        StorageError("pool exhausted"),
        errors.DatabaseUnavailable("connection refused", retry_after=4.2),
        OutcomeNotRecorded("lost", operation_id="op-1"),
        errors.CommitUncertain("lost", operation_id="op-1", retry_after=2),
        errors.CorruptRecord("bad row", tenant_id="t", operation_id="op-2", problem="json"),
    ],
)
def test_every_503_says_when_and_with_the_same_key(err: StorageError) -> None:
    answer = http_answer(err)
    assert answer.status == 503
    assert int(answer.headers["Retry-After"]) == max(1, -(-err.retry_after // 1))
    assert answer.body["retry"] == "same_key"
    assert answer.body["type"] == err.problem_type
    # The database's own words (hosts, SQL) stay on the exception.
    assert err.message not in answer.body["detail"]


def test_every_error_class_answers_with_its_type_and_every_503_with_retry_after() -> None:
    for err in every_error():
        cls = type(err)
        answer = http_answer(err)
        assert answer.body["type"] == cls.problem_type
        assert answer.content_type == "application/problem+json"
        assert answer.body["status"] == answer.status and answer.body["title"]
        assert answer.body["detail"]
        if answer.status == 503:
            assert int(answer.headers["Retry-After"]) >= 1


def test_storage_down_before_the_claim_means_the_same_key(
    sandbox_provider: SandboxProvider, sandbox: SandboxServer
) -> None:
    down = Store.from_url("postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2")
    try:
        ex = Executor(
            store=down,
            providers=[sandbox_provider],
            registry=default_registry("sandbox"),
            lease=timedelta(seconds=30),
            sleep=RecordingSleep(),
        )
        with pytest.raises(StorageError) as info:
            pay(ex, "k")
    finally:
        down.close()
    assert not isinstance(info.value, OutcomeNotRecorded)  # nothing can have committed
    answer = http_answer(info.value)
    assert (answer.status, answer.body["retry"]) == (503, "same_key")
    assert "Retry-After" in answer.headers
    assert sandbox.ledger() == []


def test_nothing_sent_is_a_503_with_the_same_key_and_no_stored_outcome(
    store: Store, sandbox: SandboxServer
) -> None:
    with SandboxProvider(base_url="http://127.0.0.1:9", timeout=httpx.Timeout(1.0)) as nowhere:
        ex = Executor(
            store=store,
            providers=[nowhere],
            registry=default_registry("sandbox"),
            lease=timedelta(seconds=30),
            sleep=RecordingSleep(),
        )
        with pytest.raises(ProviderUnavailable) as caught:
            pay(ex, "k")
    assert caught.value.operation_id is not None
    record = store.get("shop", caught.value.operation_id)
    assert record.released and record.possibly_sent is False
    assert record.response is not None and record.response["status"] == "not_sent"
    answer = http_answer(caught.value)
    # No answer invites a new key: nothing was stored, the same key runs again.
    assert (answer.status, answer.body["retry"]) == (503, "same_key")
    assert answer.body["type"] == "urn:payorch:problem:provider-unavailable"
    assert int(answer.headers["Retry-After"]) >= 1
    assert sandbox.ledger() == []


@pytest.mark.parametrize("status", [401, 403])
def test_credentials_refused_is_not_sent_never_a_decline(status: int) -> None:
    answer = answer_from_http_status(status, raw=b"<html>denied</html>")
    assert answer is not None
    assert (answer.kind, answer.code, answer.status_code) == (
        AnswerKind.NOT_SENT,
        "provider_auth_failed",
        status,
    )
    assert not answer.possibly_sent


@pytest.mark.parametrize(
    ("status", "error_type"), [(401, "authentication_error"), (403, "permission_error")]
)
def test_a_stripe_401_or_403_is_released_as_nothing_sent(
    store: Store, status: int, error_type: str
) -> None:
    body = {"error": {"type": error_type, "message": "Invalid API Key provided: sk_test_****x"}}
    timeout = httpx.Timeout(connect=1.0, read=2.0, write=1.0, pool=1.0)
    with respx.mock(base_url=STRIPE, assert_all_called=True) as mock:
        route = mock.post("/v1/payment_intents").mock(
            return_value=httpx.Response(status, json=body)
        )
        with StripeProvider(api_key="sk_test_x", base_url=STRIPE, timeout=timeout) as stripe:
            ex = Executor(
                store=store,
                providers=[stripe],
                registry=default_registry("stripe"),
                lease=timedelta(seconds=60),
                sleep=RecordingSleep(),
            )
            with pytest.raises(ProviderUnavailable) as caught:
                pay(ex, "k", payment_method="pm_card_visa")
    assert len(route.calls) == 1  # credentials are not fixed by backoff: no inline retry
    assert caught.value.operation_id is not None
    record = store.get("shop", caught.value.operation_id)
    assert (record.state, record.possibly_sent) == (State.IN_PROGRESS, False)
    assert record.released and record.response is not None  # no decline stored for the key
    assert record.response["code"] == "provider_auth_failed"
    assert caught.value.retry_after == 60.0  # Stripe's refusal is not retried every 5 s
    answer = http_answer(caught.value)
    assert answer.status == 503 and answer.status != 402
    assert answer.body["retry"] == "same_key"
    assert answer.body["code"] == "provider_auth_failed"
    [last] = [e for e in store.events("shop", record.id) if e.kind == "not_sent"]
    assert last.detail is not None and last.detail["code"] == "provider_auth_failed"
    assert "credentials" in last.detail["message"]
