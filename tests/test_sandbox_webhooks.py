"""SandboxProvider's webhooks from the real sandbox: signatures, tampering, bad bodies."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sandbox_helpers import DK_1, key_of, request
from standardwebhooks.webhooks import Webhook

from payorch.errors import ConfigurationError, WebhookMalformed, WebhookSignatureInvalid
from payorch.provider import AnswerKind
from payorch.providers.sandbox import Fault, SandboxProvider, SandboxServer


@pytest.fixture
def sandbox() -> Iterator[SandboxServer]:
    with SandboxServer() as sb:
        yield sb


@pytest.fixture
def provider(sandbox: SandboxServer) -> Iterator[SandboxProvider]:
    with SandboxProvider(base_url=sandbox.url, webhook_secret=sandbox.webhook_secret) as p:
        yield p


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
