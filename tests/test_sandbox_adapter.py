"""SandboxProvider against the real sandbox on loopback, plus odd bodies via MockTransport."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from payorch.core import downstream_key, namespace_ref
from payorch.errors import (
    ConfigurationError,
    ProviderIdempotencyError,
    WebhookMalformed,
    WebhookSignatureInvalid,
)
from payorch.provider import (
    RAW_EVIDENCE_LIMIT,
    Answer,
    AnswerKind,
    Provider,
    StatusQuery,
    SubmitRequest,
)
from payorch.providers.sandbox import DEFAULT_TIMEOUT, Fault, SandboxProvider, SandboxServer

SHORT_READ = httpx.Timeout(connect=2.0, read=0.3, write=2.0, pool=2.0)


@pytest.fixture
def sandbox() -> Iterator[SandboxServer]:
    with SandboxServer() as sb:
        yield sb


@pytest.fixture
def provider(sandbox: SandboxServer) -> Iterator[SandboxProvider]:
    with SandboxProvider(base_url=sandbox.url, webhook_secret=sandbox.webhook_secret) as p:
        yield p


def key_of(idempotency_key: str) -> str:
    """The downstream key payorch sends for the client's key (from the namespace)."""
    return downstream_key(namespace_ref("t_1", "payment.create", idempotency_key))


DK_1 = key_of("order-1")


def request(key: str = "order-1", operation_id: str = "op_1", **payload: Any) -> SubmitRequest:
    """A request as the executor makes it for the client's ``key``."""
    body: dict[str, Any] = {
        "amount": 1250,
        "currency": "EUR",
        "customer": "cus_1",
        "payment_method": "pm_card_visa",
    }
    body.update(payload)
    return SubmitRequest(
        tenant_id="t_1",
        operation="payment.create",
        operation_id=operation_id,
        downstream_key=key_of(key),
        payload=body,
        idempotency_key=key,
        fingerprint="f" * 64,
    )


def query(key: str = "order-1", reference: str | None = None) -> StatusQuery:
    return StatusQuery(
        tenant_id="t_1",
        operation="payment.create",
        operation_id="op_1",
        downstream_key=key_of(key),
        provider_reference=reference,
        idempotency_key=key,
        fingerprint="f" * 64,
    )


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
    with SandboxProvider(base_url=sandbox.url, timeout=SHORT_READ) as provider:
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


# -- webhooks ----------------------------------------------------------------------------


def test_webhook_round_trip(sandbox: SandboxServer, provider: SandboxProvider) -> None:
    sandbox.inject(Fault.PENDING)
    submitted = provider.submit(request())
    assert submitted.provider_reference is not None
    sandbox.settle(submitted.provider_reference)
    provider.submit(request("order-2", "op_2", payment_method="pm_card_declined"))
    events = [provider.parse_webhook(d.headers, d.body) for d in sandbox.webhook_deliveries()]
    assert [e.outcome for e in events] == [
        AnswerKind.PENDING,
        AnswerKind.SUCCEEDED,
        AnswerKind.DECLINED,
    ]
    first = events[0]
    assert first.event_type == "effect.processing"
    assert first.provider_reference == submitted.provider_reference
    assert first.downstream_key == DK_1
    assert first.operation_id is None  # the operation id never crosses to the provider
    assert first.event_id == sandbox.webhook_deliveries()[0].event_id
    assert first.occurred_at is not None and first.occurred_at.tzinfo is not None
    assert first.body["data"]["id"] == submitted.provider_reference
    assert events[2].downstream_key == key_of("order-2") and events[2].operation_id is None
    assert len({e.event_id for e in events}) == 3


def test_webhook_header_names_are_case_insensitive(
    sandbox: SandboxServer, provider: SandboxProvider
) -> None:
    provider.submit(request())
    [delivery] = sandbox.webhook_deliveries()
    shouted = {k.upper(): v for k, v in delivery.headers.items()}
    assert provider.parse_webhook(shouted, delivery.body).outcome is AnswerKind.SUCCEEDED


def sign(
    secret: str,
    body: bytes,
    *,
    event_id: str = "evt_test",
    at: datetime | None = None,
) -> dict[str, str]:
    when = at or datetime.now(UTC)
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(int(when.timestamp())),
        "webhook-signature": Webhook(secret).sign(event_id, when, body.decode()),
    }


@pytest.mark.parametrize(
    "tamper",
    [
        lambda h, b: (h, b.replace(b"succeeded", b"declined")),
        lambda h, b: ({k: v for k, v in h.items() if k != "webhook-signature"}, b),
        lambda h, b: ({**h, "webhook-signature": "v1,AAAA"}, b),
        lambda h, b: ({**h, "webhook-signature": "garbage"}, b),
        lambda h, b: ({**h, "webhook-id": "evt_other"}, b),
        lambda h, b: ({**h, "webhook-timestamp": "not-a-number"}, b),
        lambda h, b: (h, b"\xff" + b),
    ],
)
def test_tampered_webhooks_are_rejected(
    sandbox: SandboxServer,
    provider: SandboxProvider,
    tamper: Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]],
) -> None:
    provider.submit(request())
    [delivery] = sandbox.webhook_deliveries()
    headers, body = tamper(dict(delivery.headers), delivery.body)
    with pytest.raises(WebhookSignatureInvalid):
        provider.parse_webhook(headers, body)


@pytest.mark.parametrize("age", [timedelta(minutes=10), -timedelta(minutes=10)])
def test_stale_or_future_timestamp_is_rejected(
    sandbox: SandboxServer, provider: SandboxProvider, age: timedelta
) -> None:
    provider.submit(request())
    [delivery] = sandbox.webhook_deliveries()
    headers = sign(sandbox.webhook_secret, delivery.body, at=datetime.now(UTC) - age)
    with pytest.raises(WebhookSignatureInvalid):
        provider.parse_webhook(headers, delivery.body)


def test_another_secret_is_rejected(sandbox: SandboxServer) -> None:
    with (
        SandboxServer() as other,
        SandboxProvider(base_url=sandbox.url, webhook_secret=other.webhook_secret) as provider,
    ):
        provider.submit(request())
        [delivery] = sandbox.webhook_deliveries()
        with pytest.raises(WebhookSignatureInvalid):
            provider.parse_webhook(delivery.headers, delivery.body)


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        b'{"id": "evt_1"}',
        b'{"type": "effect.succeeded", "data": "nope"}',
        b'{"type": "effect.declined", "data": {"status": "declined"}}',
    ],
)
def test_signed_but_malformed(
    sandbox: SandboxServer, provider: SandboxProvider, body: bytes
) -> None:
    with pytest.raises(WebhookMalformed):
        provider.parse_webhook(sign(sandbox.webhook_secret, body), body)


def test_other_event_types_have_no_outcome(
    sandbox: SandboxServer, provider: SandboxProvider
) -> None:
    body = json.dumps({"id": "evt_9", "type": "account.updated", "created": 1, "data": {}})
    event = provider.parse_webhook(sign(sandbox.webhook_secret, body.encode()), body.encode())
    assert event.outcome is None
    assert event.event_type == "account.updated"
    assert event.event_id == "evt_test"  # the signed webhook-id header wins
    assert event.occurred_at == datetime.fromtimestamp(1, tz=UTC)


def test_parse_webhook_needs_a_secret(sandbox: SandboxServer) -> None:
    with SandboxProvider(base_url=sandbox.url) as provider, pytest.raises(ConfigurationError):
        provider.parse_webhook({}, b"{}")


# -- odd answers through MockTransport ---------------------------------------------------


def mocked(handler: Callable[[httpx.Request], httpx.Response]) -> SandboxProvider:
    return SandboxProvider(base_url="http://sandbox.test", transport=httpx.MockTransport(handler))


def answer_for(response: httpx.Response, *, as_query: bool = False) -> Answer:
    with mocked(lambda r: response) as provider:
        return provider.query_status(query()) if as_query else provider.submit(request())


def test_the_request_is_what_the_server_expects() -> None:
    seen: list[httpx.Request] = []

    def handler(r: httpx.Request) -> httpx.Response:
        seen.append(r)
        return httpx.Response(200, json={"id": "sbx_1", "status": "succeeded"})

    with mocked(handler) as provider:
        provider.submit(request())
        provider.query_status(query())
        provider.query_status(query(reference="sbx/1"))
    post, by_key, by_ref = seen
    assert post.method == "POST"
    assert post.url == "http://sandbox.test/v1/operations/payment.create"
    assert post.headers["idempotency-key"] == DK_1
    assert json.loads(post.content)["metadata"] == request().tags
    assert set(request().tags) == {
        "payorch_ref",
        "payorch_tenant_id",
        "payorch_operation",
        "payorch_idempotency_key",
        "payorch_fingerprint",
    }
    assert by_key.url.path == "/v1/effects"
    assert dict(by_key.url.params) == {"idempotency_key": DK_1}
    assert by_ref.url.raw_path == b"/v1/effects/sbx%2F1"
    assert post.extensions["timeout"] == DEFAULT_TIMEOUT.as_dict()


@pytest.mark.parametrize(
    "body", [b"<html>oops</html>", b"", b'{"status": "succeeded"}', b'["id"]', b"x" * 10_000]
)
def test_200_without_an_effect_is_ambiguous(body: bytes) -> None:
    answer = answer_for(httpx.Response(200, content=body))
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.status_code == 200
    assert answer.code == "unexpected_body"
    if answer.body is None:
        assert answer.raw is not None and len(answer.raw) <= RAW_EVIDENCE_LIMIT


def test_200_with_an_unknown_status_is_ambiguous() -> None:
    answer = answer_for(httpx.Response(200, json={"id": "sbx_1", "status": "reversed"}))
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.provider_reference == "sbx_1"


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_5xx_is_ambiguous_with_raw_evidence(status: int) -> None:
    for as_query in (False, True):
        answer = answer_for(httpx.Response(status, text="<h1>Bad Gateway</h1>"), as_query=as_query)
        assert answer.kind is AnswerKind.AMBIGUOUS
        assert answer.status_code == status
        assert answer.raw == "<h1>Bad Gateway</h1>"


def test_429_on_query_is_not_sent() -> None:
    answer = answer_for(httpx.Response(429, headers={"Retry-After": "4"}), as_query=True)
    assert answer.kind is AnswerKind.NOT_SENT
    assert answer.retry_after == 4.0


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (400, {"error": {"type": "invalid_request_error", "code": "amount_too_small"}}, None),
    ],
)
def test_a_4xx_the_acquirer_explains_is_declined(status: int, body: Any, code: str | None) -> None:
    answer = answer_for(httpx.Response(status, content=json.dumps(body).encode()))
    assert answer.kind is AnswerKind.DECLINED
    assert answer.status_code == status
    assert answer.code == (code or body["error"]["code"])


def test_a_401_is_a_configuration_fault_never_a_decline() -> None:
    body = {"error": {"type": "authentication_error", "code": "bad_key"}}
    answer = answer_for(httpx.Response(401, content=json.dumps(body).encode()))
    assert (answer.kind, answer.code) == (AnswerKind.NOT_SENT, "provider_auth_failed")


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, b"not found"),
        (408, b""),
        (409, json.dumps({"error": {"type": "idempotency_error", "code": "other"}}).encode()),
        (499, b"<html>proxy</html>"),
    ],
)
def test_a_4xx_without_the_acquirers_reason_is_ambiguous(status: int, body: bytes) -> None:
    # Possibly from a proxy in front of the acquirer, after it committed: never final.
    answer = answer_for(httpx.Response(status, content=body))
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.status_code == status


def test_odd_query_answers_are_ambiguous() -> None:
    assert answer_for(httpx.Response(400, json={}), as_query=True).kind is AnswerKind.AMBIGUOUS
    assert answer_for(httpx.Response(200, json={"x": 1}), as_query=True).kind is (
        AnswerKind.AMBIGUOUS
    )
    assert answer_for(httpx.Response(200, text="nope"), as_query=True).kind is (
        AnswerKind.AMBIGUOUS
    )
    # 404 by key (no such route) is not "the provider knows nothing".
    assert answer_for(httpx.Response(404), as_query=True).kind is AnswerKind.AMBIGUOUS


def test_a_redirect_is_ambiguous() -> None:
    answer = answer_for(httpx.Response(302, headers={"Location": "/elsewhere"}))
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.code == "http_302"


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("refused"), AnswerKind.NOT_SENT),
        (httpx.ConnectTimeout("slow"), AnswerKind.NOT_SENT),
        (httpx.PoolTimeout("busy"), AnswerKind.NOT_SENT),
        (httpx.ReadTimeout("slow"), AnswerKind.AMBIGUOUS),
        (httpx.WriteTimeout("slow"), AnswerKind.AMBIGUOUS),
        (httpx.RemoteProtocolError("eof"), AnswerKind.AMBIGUOUS),
        (httpx.ReadError("reset"), AnswerKind.AMBIGUOUS),
    ],
)
def test_transport_errors_never_escape(exc: httpx.HTTPError, kind: AnswerKind) -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        raise exc

    with mocked(handler) as provider:
        assert provider.submit(request()).kind is kind
        assert provider.query_status(query()).kind is kind
