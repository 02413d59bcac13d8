"""Verified webhooks that cannot be stored are refused with 400 before anything is written."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from payorch import WebhookHandler, WebhookStatus
from payorch.errors import WebhookMalformed, WebhookUnstorable
from payorch.http import webhook_answer
from payorch.providers.stripe import SIGNATURE_HEADER, StripeProvider
from payorch.storage._store import Store
from payorch.storage._tables import events, operations, webhook_inbox

SECRET = "whsec_test_limits"
TENANT = "shop"


def _refuse_http(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"a webhook must not call the provider: {request.url}")


@pytest.fixture
def handler(store: Store) -> Iterator[WebhookHandler]:
    with StripeProvider(
        api_key="sk_test_x",
        webhook_secret=SECRET,
        base_url="https://api.stripe.test",
        transport=httpx.MockTransport(_refuse_http),
    ) as stripe:
        yield WebhookHandler(store=store, providers=[stripe])


def delivery(
    *, event_id: str = "evt_1", event_type: str = "payment_intent.succeeded", **obj: Any
) -> tuple[dict[str, str], bytes]:
    intent = {
        "id": "pi_1",
        "object": "payment_intent",
        "status": "succeeded",
        "capture_method": "automatic",
        "metadata": {},
    } | obj
    event = {
        "id": event_id,
        "object": "event",
        "created": int(time.time()),
        "type": event_type,
        "data": {"object": intent},
    }
    body = json.dumps(event).encode()
    t = int(time.time())
    digest = hmac.new(SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return {SIGNATURE_HEADER: f"t={t},v1={digest}"}, body


def counts(store: Store) -> tuple[int, int, int]:
    with store.engine.connect() as conn:
        return tuple(  # type: ignore[return-value]
            int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
            for t in (operations, events, webhook_inbox)
        )


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"event_id": "evt_" + "x" * 252}, "event id is 256 characters long; at most 255"),
        ({"event_type": "payment_intent." + "x" * 86}, "event type is 101 characters long"),
        ({"id": "pi_" + "x" * 253}, "provider reference is 256 characters long"),
        ({"event_id": "evt_\u0000"}, "event id contains a NUL"),
        ({"event_id": "evt_\ud800"}, "event id is not valid Unicode"),
        ({"id": "pi_\u0000"}, "provider reference contains a NUL"),
    ],
)
def test_an_unstorable_verified_event_is_a_400_and_writes_nothing(
    store: Store, handler: WebhookHandler, fields: dict[str, str], what: str
) -> None:
    headers, body = delivery(**fields)
    before = counts(store)
    for _ in range(2):  # a provider re-sending it gets the same answer
        with pytest.raises(WebhookUnstorable, match=what) as caught:
            handler.handle(TENANT, "stripe", headers, body)
        assert isinstance(caught.value, WebhookMalformed)
        answer = webhook_answer(caught.value)
        assert answer.status == 400
    assert counts(store) == before == (0, 0, 0)


def test_values_that_fit_their_columns_are_stored(store: Store, handler: WebhookHandler) -> None:
    event_id = "evt_" + "x" * 251  # 255, the column's width
    event_type = "payment_intent." + "y" * 85  # 100
    headers, body = delivery(event_id=event_id, event_type=event_type, id="pi_" + "z" * 252)
    result = handler.handle(TENANT, "stripe", headers, body)
    assert result.status is WebhookStatus.UNMATCHED
    assert webhook_answer(result).status == 200
    with store.engine.connect() as conn:
        row = conn.execute(sa.select(webhook_inbox)).one()
    assert (row.event_id, row.event_type, row.result) == (event_id, event_type, "unmatched")
    again = handler.handle(TENANT, "stripe", headers, body)
    assert again.status is WebhookStatus.DUPLICATE


def test_an_operation_id_no_row_can_hold_finds_nothing(
    store: Store, handler: WebhookHandler
) -> None:
    # Metadata and keys are the sender's text: an impossible id matches no operation, and
    # never reaches the database (which would refuse a NUL outright).
    for i, tagged in enumerate(["0" * 37, "op\u0000id"]):
        headers, body = delivery(event_id=f"evt_{i}", metadata={"payorch_operation_id": tagged})
        assert handler.handle(TENANT, "stripe", headers, body).status is WebhookStatus.UNMATCHED
