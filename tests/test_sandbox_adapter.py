"""SandboxProvider against the real sandbox on loopback: its contract, submits and status
queries.

Its webhooks are in test_sandbox_webhooks.py, odd answers through MockTransport in
test_sandbox_answers.py; the requests they share in sandbox_helpers.py.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from conftest import FAST_TIMEOUT
from sandbox_helpers import DK_1, query, request

from payorch.errors import ConfigurationError, ProviderIdempotencyError
from payorch.provider import Answer, AnswerKind, Provider, SubmitRequest
from payorch.providers.sandbox import Fault, SandboxProvider, SandboxServer


@pytest.fixture
def sandbox() -> Iterator[SandboxServer]:
    with SandboxServer() as sb:
        yield sb


@pytest.fixture
def provider(sandbox: SandboxServer) -> Iterator[SandboxProvider]:
    with SandboxProvider(base_url=sandbox.url, webhook_secret=sandbox.webhook_secret) as p:
        yield p


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# -- contract ----------------------------------------------------------------------------


def test_implements_the_provider_protocol(provider: SandboxProvider) -> None:
    assert isinstance(provider, Provider)
    assert provider.name == "sandbox"
    assert provider.idempotency_window == timedelta(hours=24)
    assert provider.max_call_duration == timedelta(seconds=14)


def test_every_timeout_phase_must_be_set() -> None:
    with pytest.raises(ValueError, match="explicitly"):
        SandboxProvider(base_url="http://127.0.0.1:1", timeout=httpx.Timeout(5.0, read=None))


def test_client_or_transport_not_both() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(200))
    with httpx.Client(transport=transport) as client, pytest.raises(ValueError):
        SandboxProvider(base_url="http://x", client=client, transport=transport)


def test_a_callers_client_is_not_closed() -> None:
    with httpx.Client() as client:
        SandboxProvider(base_url="http://127.0.0.1:1", client=client).close()
        assert not client.is_closed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_url": "http://127.0.0.1:1", "webhook_secret": "whsec_***"},
        {"base_url": "http://127.0.0.1:1", "webhook_secret": ""},
        {"base_url": "127.0.0.1:8000"},
        {"base_url": "ftp://127.0.0.1"},
        {"base_url": "http://127.0.0.1:99999"},
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        SandboxProvider(**kwargs)


# -- submit against the real server ------------------------------------------------------


def test_submit_succeeds_and_tags_metadata(
    sandbox: SandboxServer, provider: SandboxProvider
) -> None:
    answer = provider.submit(request(metadata={"order": "o_9"}))
    assert answer.kind is AnswerKind.SUCCEEDED
    [effect] = sandbox.effects_for(DK_1)
    assert answer.provider_reference == effect["id"]
    assert answer.status_code == 200
    assert answer.body is not None and answer.body["id"] == effect["id"]
    assert effect["idempotency_key"] == DK_1
    # The caller's metadata, and payorch's tags from the namespace: never the operation id.
    assert effect["metadata"] == {
        "order": "o_9",
        "payorch_ref": DK_1.split(":")[1],
        "payorch_tenant_id": "t_1",
        "payorch_operation": "payment.create",
        "payorch_idempotency_key": "order-1",
        "payorch_fingerprint": "f" * 64,
    }
    assert "op_1" not in json.dumps(effect)


def test_a_request_of_the_earlier_key_form_keeps_its_earlier_tags(
    sandbox: SandboxServer, provider: SandboxProvider
) -> None:
    legacy = SubmitRequest(
        tenant_id="t_1",
        operation="payment.create",
        operation_id="op_9",
        downstream_key="payorch:op_9:submit",  # claimed before keys came from the namespace
        payload={"amount": 1250, "currency": "EUR", "customer": "cus_1"},
        idempotency_key="order-9",
    )
    assert provider.submit(legacy).kind is AnswerKind.SUCCEEDED
    [effect] = sandbox.effects_for("op_9")  # found by its operation id, as it was tagged
    # Byte for byte what the sandbox adapter sent before: a re-submission repeats it.
    assert effect["metadata"] == {"operation_id": "op_9", "tenant_id": "t_1"}
    [delivery] = sandbox.webhook_deliveries()
    event = provider.parse_webhook(delivery.headers, delivery.body)
    assert (event.operation_id, event.downstream_key) == ("op_9", "payorch:op_9:submit")


def test_resubmit_is_replayed(sandbox: SandboxServer, provider: SandboxProvider) -> None:
    first = provider.submit(request())
    second = provider.submit(request())
    assert second.kind is AnswerKind.SUCCEEDED
    assert second.provider_reference == first.provider_reference
    assert len(sandbox.ledger()) == 1


def test_changed_payload_under_same_key(sandbox: SandboxServer, provider: SandboxProvider) -> None:
    provider.submit(request())
    with pytest.raises(ProviderIdempotencyError) as caught:
        provider.submit(request(amount=9999))
    assert caught.value.operation_id == "op_1"
    assert len(sandbox.ledger()) == 1


def test_past_the_window_a_resubmit_makes_a_second_effect(
    sandbox: SandboxServer, provider: SandboxProvider
) -> None:
    first = provider.submit(request())
    sandbox.advance(provider.idempotency_window or timedelta(0))
    second = provider.submit(request())
    assert second.kind is AnswerKind.SUCCEEDED
    assert second.provider_reference != first.provider_reference
    assert len(sandbox.effects_for(DK_1)) == 2
    status = provider.query_status(query())
    assert status.kind is AnswerKind.SUCCEEDED
    assert status.message == "2 effects for this key"


def test_declined_card(sandbox: SandboxServer, provider: SandboxProvider) -> None:
    answer = provider.submit(request(payment_method="pm_card_declined"))
    assert answer.kind is AnswerKind.DECLINED
    assert answer.code == "generic_decline"
    assert answer.status_code == 402
    [entry] = sandbox.ledger()
    assert answer.provider_reference == entry["id"]
    assert answer.possibly_sent  # a decline was sent, and is final


@pytest.mark.parametrize(
    ("fault", "kind", "effects"),
    [
        (Fault.LATENCY, AnswerKind.SUCCEEDED, ["succeeded"]),
        (Fault.DECLINE, AnswerKind.DECLINED, ["declined"]),
        (Fault.PENDING, AnswerKind.PENDING, ["processing"]),
        (Fault.ERROR_500_BEFORE, AnswerKind.AMBIGUOUS, []),
        (Fault.ERROR_500_AFTER, AnswerKind.AMBIGUOUS, ["succeeded"]),
        (Fault.RESET_AFTER, AnswerKind.AMBIGUOUS, ["succeeded"]),
        (Fault.RATE_LIMIT, AnswerKind.NOT_SENT, []),
    ],
)
def test_fault_classification(
    sandbox: SandboxServer,
    provider: SandboxProvider,
    fault: Fault,
    kind: AnswerKind,
    effects: list[str],
) -> None:
    sandbox.inject(fault)
    answer = provider.submit(request())
    assert answer.kind is kind
    assert [e["status"] for e in sandbox.effects_for(DK_1)] == effects
    # Whatever happened, a resubmit with the same key never adds a second money movement.
    provider.submit(request())
    moved = [e for e in sandbox.effects_for(DK_1) if e["status"] != "declined"]
    assert len(moved) <= 1


def test_error_500_evidence(provider: SandboxProvider, sandbox: SandboxServer) -> None:
    sandbox.inject(Fault.ERROR_500_AFTER)
    answer = provider.submit(request())
    assert answer.status_code == 500
    assert answer.code == "http_500"
    assert answer.body == {"error": {"type": "api_error"}}
    assert answer.possibly_sent


def test_reset_evidence(provider: SandboxProvider, sandbox: SandboxServer) -> None:
    sandbox.inject(Fault.RESET_AFTER)
    answer = provider.submit(request())
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.code == "ReadError"


def test_rate_limit_carries_retry_after() -> None:
    with (
        SandboxServer(retry_after="3") as sb,
        SandboxProvider(base_url=sb.url) as provider,
    ):
        sb.inject(Fault.RATE_LIMIT)
        answer = provider.submit(request())
        assert answer.kind is AnswerKind.NOT_SENT
        assert answer.retry_after == 3.0
        assert answer.status_code == 429
        assert sb.ledger() == []


def test_dropped_response_is_ambiguous_and_committed(sandbox: SandboxServer) -> None:
    with SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT) as provider:
        sandbox.inject(Fault.DROP_AFTER)
        answer = provider.submit(request())
        assert answer.kind is AnswerKind.AMBIGUOUS
        assert answer.code == "ReadTimeout"
        [effect] = sandbox.effects_for(DK_1)
        # Resubmitting with the same downstream key recovers the committed effect.
        again = provider.submit(request())
    assert again.kind is AnswerKind.SUCCEEDED
    assert again.provider_reference == effect["id"]


def test_closed_port_is_not_sent() -> None:
    with SandboxProvider(base_url=f"http://127.0.0.1:{closed_port()}") as provider:
        answer = provider.submit(request())
        assert answer.kind is AnswerKind.NOT_SENT
        assert answer.code == "ConnectError"
        assert not answer.possibly_sent
        assert provider.query_status(query()).kind is AnswerKind.NOT_SENT


def test_in_progress_is_not_sent(sandbox: SandboxServer, provider: SandboxProvider) -> None:
    answers: list[Answer] = []
    with sandbox.hold_commits() as gate:
        first = threading.Thread(target=lambda: answers.append(provider.submit(request())))
        first.start()
        try:
            assert gate.wait_held(1, timeout=30)
            second = provider.submit(request())
        finally:
            gate.release()
            first.join(30)
    assert second.kind is AnswerKind.NOT_SENT
    assert second.code == "request_in_progress"
    assert second.retry_after == 1.0
    assert answers[0].kind is AnswerKind.SUCCEEDED
    assert len(sandbox.ledger()) == 1


# -- query_status against the real server ------------------------------------------------


def test_query_by_reference_and_by_key(provider: SandboxProvider) -> None:
    submitted = provider.submit(request())
    for q in (query(), query(reference=submitted.provider_reference)):
        answer = provider.query_status(q)
        assert answer.kind is AnswerKind.SUCCEEDED
        assert answer.provider_reference == submitted.provider_reference


def test_query_unknown(provider: SandboxProvider) -> None:
    assert provider.query_status(query("order-none")).kind is AnswerKind.NOT_FOUND
    answer = provider.query_status(query(reference="sbx_none"))
    assert answer.kind is AnswerKind.NOT_FOUND
    assert answer.status_code == 404


def test_status_lag_is_not_found_until_time_passes() -> None:
    with (
        SandboxServer(status_lag=timedelta(seconds=20)) as sb,
        SandboxProvider(base_url=sb.url) as provider,
    ):
        submitted = provider.submit(request())
        assert provider.query_status(query()).kind is AnswerKind.NOT_FOUND
        ref = submitted.provider_reference
        assert provider.query_status(query(reference=ref)).kind is AnswerKind.NOT_FOUND
        sb.advance(20)
        assert provider.query_status(query()).kind is AnswerKind.SUCCEEDED
        assert provider.query_status(query(reference=ref)).kind is AnswerKind.SUCCEEDED


def test_pending_then_settled(sandbox: SandboxServer, provider: SandboxProvider) -> None:
    sandbox.inject(Fault.PENDING)
    submitted = provider.submit(request())
    assert submitted.kind is AnswerKind.PENDING
    ref = submitted.provider_reference
    assert ref is not None
    assert provider.query_status(query(reference=ref)).kind is AnswerKind.PENDING
    sandbox.settle(ref)
    assert provider.query_status(query(reference=ref)).kind is AnswerKind.SUCCEEDED
    assert provider.query_status(query()).kind is AnswerKind.SUCCEEDED


def test_pending_settles_with_the_clock() -> None:
    with (
        SandboxServer(settle_after=timedelta(minutes=5)) as sb,
        SandboxProvider(base_url=sb.url) as provider,
    ):
        sb.inject(Fault.PENDING)
        provider.submit(request())
        assert provider.query_status(query()).kind is AnswerKind.PENDING
        sb.advance(timedelta(minutes=5))
        assert provider.query_status(query()).kind is AnswerKind.SUCCEEDED


def test_query_declined(provider: SandboxProvider) -> None:
    provider.submit(request(payment_method="pm_card_declined"))
    answer = provider.query_status(query())
    assert answer.kind is AnswerKind.DECLINED
    assert answer.code == "generic_decline"
