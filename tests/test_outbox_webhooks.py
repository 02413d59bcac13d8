"""The outbox's webhook sink (Standard Webhooks) and the receiver's check.

Unit tests with respx: what is sent (body, headers, signature), what counts as delivered,
how every failure is reported. Then a real receiver on loopback that verifies signatures
with the official ``standardwebhooks`` verifier and applies each ``webhook-id`` once:
a re-sent message is received twice and applied once; an endpoint that refuses for ever
gets exactly one request per attempt (the relay counts, the sink never loops); a receiver
that never answers is cut by the deadline.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import respx
from outbox_receiver import Receiver, message, receiving
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from payorch.errors import (
    ConfigurationError,
    DeliveryFailed,
    WebhookMalformed,
    WebhookSignatureInvalid,
)
from payorch.outbox import Message, Relay, RelayPolicy, find, messages, stage
from payorch.outbox._sinks import Sink
from payorch.outbox._webhooks import (
    WebhookEndpoint,
    WebhookSink,
    verify_webhook,
    webhook_body,
)
from payorch.storage._store import Store

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"o" * 24).decode()
URL = "https://merchant.example/hooks/payorch"


@pytest.fixture
def sink() -> Iterator[WebhookSink]:
    s = WebhookSink({"t1": WebhookEndpoint(URL, SECRET)})
    yield s
    s.close()


@pytest.fixture
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as router:
        yield router


def sent(route: respx.Route, n: int = -1) -> httpx.Request:
    request: httpx.Request = route.calls[n].request
    return request


# -- what is sent -----------------------------------------------------------------------------


def test_is_a_sink(sink: WebhookSink) -> None:
    assert isinstance(sink, Sink)
    assert sink.deadline == 15.0  # every phase of the default time-out added up


def test_posts_the_recommended_body_with_the_standard_headers(
    sink: WebhookSink, mock: respx.MockRouter
) -> None:
    route = mock.post(URL).respond(200)
    m = message()
    sink.deliver(m)
    request = sent(route)
    assert request.method == "POST"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["webhook-id"] == m.id
    assert request.headers["webhook-timestamp"].isdigit()
    assert json.loads(request.content) == {
        "type": "payment.succeeded",
        "timestamp": "2025-03-01T12:30:45.123456Z",
        "data": {"amount": 4200, "currency": "EUR", "note": "café"},
    }
    assert request.content == webhook_body(m)


def test_the_signature_passes_the_official_verifier_and_the_specs_formula(
    sink: WebhookSink, mock: respx.MockRouter
) -> None:
    route = mock.post(URL).respond(204)
    m = message()
    sink.deliver(m)
    request = sent(route)
    headers = dict(request.headers)
    # The official verifier (the same library the spec's authors publish).
    assert Webhook(SECRET).verify(request.content, headers) == json.loads(request.content)
    # And the formula itself, written out: HMAC-SHA256 over "id.timestamp.body".
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    signed = f"{m.id}.{headers['webhook-timestamp']}.".encode() + request.content
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert headers["webhook-signature"] == f"v1,{expected}"
    # And our own receiver-side helper.
    assert verify_webhook(request.content, headers, SECRET)["type"] == "payment.succeeded"


def test_every_attempt_sends_the_same_id_and_body(
    sink: WebhookSink, mock: respx.MockRouter
) -> None:
    route = mock.post(URL).mock(side_effect=[httpx.Response(503), httpx.Response(200)])
    m = message()
    with pytest.raises(DeliveryFailed):
        sink.deliver(m)
    sink.deliver(message(id=m.id, attempt=2))  # the relay's next attempt
    first, second = sent(route, 0), sent(route, 1)
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == m.id
    assert first.content == second.content  # the event's timestamp, not the attempt's


def test_each_tenant_has_its_own_endpoint_and_secret(mock: respx.MockRouter) -> None:
    other_url = "https://other.example/in"
    a = mock.post(URL).respond(200)
    b = mock.post(other_url).respond(200)
    sink = WebhookSink(
        {"t1": WebhookEndpoint(URL, SECRET), "t2": WebhookEndpoint(other_url, OTHER_SECRET)}
    )
    sink.deliver(message(tenant_id="t1"))
    sink.deliver(message(tenant_id="t2"))
    assert a.call_count == b.call_count == 1
    to_b = sent(b)
    Webhook(OTHER_SECRET).verify(to_b.content, dict(to_b.headers))
    with pytest.raises(WebhookVerificationError):  # t1's secret does not sign t2's webhooks
        Webhook(SECRET).verify(to_b.content, dict(to_b.headers))


def test_endpoints_may_come_from_a_function(mock: respx.MockRouter) -> None:
    route = mock.post(URL).respond(200)
    asked: list[str] = []

    def lookup(tenant: str) -> WebhookEndpoint | None:
        asked.append(tenant)
        return WebhookEndpoint(URL, SECRET) if tenant == "t1" else None

    sink = WebhookSink(lookup)
    sink.deliver(message(tenant_id="t1"))
    with pytest.raises(DeliveryFailed, match="no webhook endpoint for tenant 't2'"):
        sink.deliver(message(tenant_id="t2"))
    assert asked == ["t1", "t2"]
    assert route.call_count == 1


def test_a_tenant_with_no_endpoint_fails_and_sends_nothing(
    sink: WebhookSink, mock: respx.MockRouter
) -> None:
    route = mock.post(URL).respond(200)
    with pytest.raises(DeliveryFailed, match="no webhook endpoint for tenant 'nobody'") as e:
        sink.deliver(message(tenant_id="nobody"))
    assert e.value.retry_after is None
    assert route.call_count == 0


def test_previous_secrets_sign_too_for_a_rotation(mock: respx.MockRouter) -> None:
    route = mock.post(URL).respond(200)
    sink = WebhookSink({"t1": WebhookEndpoint(URL, SECRET, previous_secrets=(OTHER_SECRET,))})
    sink.deliver(message())
    request = sent(route)
    assert len(request.headers["webhook-signature"].split(" ")) == 2
    for secret in (SECRET, OTHER_SECRET):  # a receiver on either secret accepts it
        verify_webhook(request.content, dict(request.headers), secret)


def test_a_message_id_with_a_dot_is_refused(sink: WebhookSink, mock: respx.MockRouter) -> None:
    route = mock.post(URL).respond(200)
    with pytest.raises(DeliveryFailed, match=r"empty or contains '\.'"):
        sink.deliver(message(id="a.b"))
    assert route.call_count == 0


def test_a_payload_with_no_json_form_is_a_failure(
    sink: WebhookSink, mock: respx.MockRouter
) -> None:
    mock.post(URL).respond(200)
    with pytest.raises(DeliveryFailed, match="no JSON form"):
        sink.deliver(message(payload={"amount": float("nan")}))


# -- what counts as delivered ---------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_any_2xx_is_delivered(sink: WebhookSink, mock: respx.MockRouter, status: int) -> None:
    mock.post(URL).respond(status)
    sink.deliver(message())


@pytest.mark.parametrize("status", [301, 308, 400, 401, 404, 409, 410, 422, 500, 502, 503, 504])
def test_anything_else_is_a_failure_named_by_its_status(
    sink: WebhookSink, mock: respx.MockRouter, status: int
) -> None:
    route = mock.post(URL).respond(status, headers={"location": "https://elsewhere.example/"})
    with pytest.raises(DeliveryFailed) as caught:
        sink.deliver(message())
    assert caught.value.message == f"http_{status}"
    assert caught.value.retry_after is None
    assert route.call_count == 1  # a redirect is not followed; nothing is retried here


def test_429_with_retry_after_seconds_is_honoured(
    sink: WebhookSink, mock: respx.MockRouter
) -> None:
    mock.post(URL).respond(429, headers={"retry-after": "7"})
    with pytest.raises(DeliveryFailed, match="http_429") as caught:
        sink.deliver(message())
    assert caught.value.retry_after == 7.0


def test_503_with_retry_after_date_is_honoured(sink: WebhookSink, mock: respx.MockRouter) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    mock.post(URL).respond(503, headers={"retry-after": format_datetime(later, usegmt=True)})
    with pytest.raises(DeliveryFailed, match="http_503") as caught:
        sink.deliver(message())
    assert caught.value.retry_after is not None
    assert 3000 < caught.value.retry_after <= 3600


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("0", 0.0),
        ("-5", 0.0),
        ("soon", None),
        ("inf", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date in the past: now
    ],
)
def test_odd_retry_after_values(
    sink: WebhookSink, mock: respx.MockRouter, header: str, expected: float | None
) -> None:
    mock.post(URL).respond(429, headers={"retry-after": header})
    with pytest.raises(DeliveryFailed) as caught:
        sink.deliver(message())
    assert caught.value.retry_after == expected


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectTimeout,
        httpx.ConnectError,
        httpx.ReadTimeout,
        httpx.WriteTimeout,
        httpx.PoolTimeout,
        httpx.RemoteProtocolError,
        httpx.ReadError,
    ],
)
def test_transport_errors_are_failures_named_by_their_type(
    sink: WebhookSink, mock: respx.MockRouter, error: type[Exception]
) -> None:
    mock.post(URL).mock(side_effect=error)
    with pytest.raises(DeliveryFailed) as caught:
        sink.deliver(message())
    assert caught.value.message == error.__name__
    assert caught.value.retry_after is None


def test_a_callers_client_is_used_and_not_closed(mock: respx.MockRouter) -> None:
    route = mock.post(URL).respond(200)
    client = httpx.Client()
    sink = WebhookSink({"t1": WebhookEndpoint(URL, SECRET)}, client=client)
    sink.deliver(message())
    sink.close()
    assert not client.is_closed
    assert route.call_count == 1
    client.close()


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("secret", "text"),
    [
        ("", "'whsec_' followed by base64"),
        (base64.b64encode(b"k" * 32).decode(), "'whsec_' followed by base64"),  # no prefix
        ("whsec_not*base64!", "must be base64"),
        ("whsec_", "decode to 24 to 64 bytes, not 0"),
        ("whsec_" + base64.b64encode(b"k" * 16).decode(), "not 16"),
        ("whsec_" + base64.b64encode(b"k" * 65).decode(), "not 65"),
    ],
)
def test_a_bad_secret_is_refused(secret: str, text: str) -> None:
    with pytest.raises(ConfigurationError, match=text):
        WebhookEndpoint(URL, secret)


def test_an_unpadded_secret_is_accepted() -> None:
    padded = base64.b64encode(b"k" * 25).decode()
    assert padded.endswith("=")
    WebhookEndpoint(URL, "whsec_" + padded.rstrip("="))


@pytest.mark.parametrize(
    "url",
    ["", "ftp://merchant.example/x", "merchant.example/hooks", "http:///nohost", "http://h:0/"],
)
def test_a_bad_url_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="webhook URL"):
        WebhookEndpoint(url, SECRET)


def test_the_secret_is_never_in_the_repr() -> None:
    endpoint = WebhookEndpoint(URL, SECRET, previous_secrets=(OTHER_SECRET,))
    assert SECRET not in repr(endpoint) and OTHER_SECRET not in repr(endpoint)
    assert URL in repr(endpoint)


def test_sink_configuration_is_checked() -> None:
    endpoints = {"t1": WebhookEndpoint(URL, SECRET)}
    with pytest.raises(ConfigurationError, match="deadline must be positive"):
        WebhookSink(endpoints, deadline=timedelta(0))
    with pytest.raises(ConfigurationError, match="time-out"):
        WebhookSink(endpoints, timeout=httpx.Timeout(5.0, read=None))
    with pytest.raises(ConfigurationError, match="must not follow redirects"):
        WebhookSink(endpoints, client=httpx.Client(follow_redirects=True))
    with pytest.raises(ConfigurationError, match="expected a WebhookEndpoint"):
        WebhookSink({"t1": URL})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="previous_secrets is a tuple"):
        WebhookEndpoint(URL, SECRET, previous_secrets=OTHER_SECRET)  # type: ignore[arg-type]


# -- the receiving end: verify_webhook --------------------------------------------------------


def signed(body: bytes, *, secret: str = SECRET, at: datetime | None = None) -> dict[str, str]:
    moment = at or datetime.now(UTC)
    msg_id = "msg_1"
    return {
        "Webhook-Id": msg_id,  # any case
        "Webhook-Timestamp": str(int(moment.timestamp())),
        "Webhook-Signature": Webhook(secret).sign(msg_id, moment, body.decode()),
    }


BODY = b'{"type":"payment.succeeded","timestamp":"2025-03-01T12:30:45Z","data":{"a":1}}'


def test_verify_returns_the_body() -> None:
    assert verify_webhook(BODY, signed(BODY), SECRET)["data"] == {"a": 1}
    assert verify_webhook(BODY.decode(), signed(BODY), SECRET)["type"] == "payment.succeeded"


@pytest.mark.parametrize(
    "tamper",
    [
        lambda h: {**h, "Webhook-Signature": "v1,AAAA"},
        lambda h: {**h, "Webhook-Signature": "v1"},  # garbled: no comma
        lambda h: {**h, "Webhook-Signature": "v1,***"},  # garbled: not base64
        lambda h: {**h, "Webhook-Id": "msg_2"},
        lambda h: {k: v for k, v in h.items() if k != "Webhook-Signature"},
        lambda h: {},
    ],
)
def test_verify_refuses_a_bad_or_missing_signature(tamper: Any) -> None:
    with pytest.raises(WebhookSignatureInvalid):
        verify_webhook(BODY, tamper(signed(BODY)), SECRET)


def test_verify_refuses_another_secret_a_changed_body_and_a_stale_timestamp() -> None:
    with pytest.raises(WebhookSignatureInvalid):
        verify_webhook(BODY, signed(BODY, secret=OTHER_SECRET), SECRET)
    with pytest.raises(WebhookSignatureInvalid):
        verify_webhook(BODY.replace(b'"a":1', b'"a":2'), signed(BODY), SECRET)
    stale = datetime.now(UTC) - timedelta(minutes=30)
    with pytest.raises(WebhookSignatureInvalid, match="too old"):
        verify_webhook(BODY, signed(BODY, at=stale), SECRET)
    with pytest.raises(WebhookSignatureInvalid):
        verify_webhook(b"\xff\xfe", signed(BODY), SECRET)  # not UTF-8


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"data": {}}', b'{"type": 3}'])
def test_verify_refuses_a_signed_body_of_the_wrong_shape(body: bytes) -> None:
    with pytest.raises(WebhookMalformed):
        verify_webhook(body, signed(body), SECRET)


def test_verify_refuses_a_bad_secret() -> None:
    with pytest.raises(ConfigurationError):
        verify_webhook(BODY, signed(BODY), "secret")


# -- a real receiver on loopback --------------------------------------------------------------


@pytest.fixture
def merchant() -> Iterator[Receiver]:
    with receiving(SECRET) as endpoint:
        yield endpoint


def test_a_resent_message_is_received_twice_and_applied_once(merchant: Receiver) -> None:
    sink = WebhookSink({"t1": WebhookEndpoint(merchant.url, SECRET)})
    try:
        m = message()
        sink.deliver(m)
        # The relay crashed before marking it delivered: the next relay sends it again.
        sink.deliver(message(id=m.id, attempt=2))
        sink.deliver(message(payload={"amount": 1, "currency": "EUR"}))
    finally:
        sink.close()
    assert merchant.requests == 3
    assert merchant.refused == 0
    assert len(merchant.applied) == 2
    assert merchant.applied[m.id] == {"amount": 4200, "currency": "EUR", "note": "café"}


def test_an_endpoint_that_refuses_for_ever_gets_one_request_per_attempt(
    merchant: Receiver,
) -> None:
    merchant.status = 410
    sink = WebhookSink({"t1": WebhookEndpoint(merchant.url, SECRET)})
    m = message()
    try:
        for attempt in range(1, 6):  # the relay's attempts, up to its max_attempts
            with pytest.raises(DeliveryFailed, match="http_410"):
                sink.deliver(message(id=m.id, attempt=attempt))
    finally:
        sink.close()
    assert merchant.requests == 5  # the sink itself never retried
    assert merchant.applied == {}


def test_a_wrong_secret_is_refused_by_the_receiver(merchant: Receiver) -> None:
    sink = WebhookSink({"t1": WebhookEndpoint(merchant.url, OTHER_SECRET)})
    try:
        with pytest.raises(DeliveryFailed, match="http_400"):
            sink.deliver(message())
    finally:
        sink.close()
    assert merchant.refused == 1
    assert merchant.applied == {}


def test_a_receiver_that_never_answers_is_cut_by_the_deadline(merchant: Receiver) -> None:
    merchant.hold.clear()  # the receiver takes the request and keeps it
    sink = WebhookSink(
        {"t1": WebhookEndpoint(merchant.url, SECRET)}, deadline=timedelta(seconds=0.5)
    )
    try:
        with pytest.raises(DeliveryFailed) as caught:
            sink.deliver(message())
    finally:
        merchant.hold.set()
        sink.close()
    assert caught.value.message == "DeadlineExceeded"


def test_nothing_listening_is_a_connect_error() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()  # the port is free again: nothing listens there
    sink = WebhookSink({"t1": WebhookEndpoint(f"http://127.0.0.1:{port}/", SECRET)})
    try:
        with pytest.raises(DeliveryFailed, match="ConnectError"):
            sink.deliver(message())
    finally:
        sink.close()


# -- through the relay: a receiver that refuses for ever is dead-lettered ---------------------


def test_through_the_relay_a_refusing_endpoint_is_dead_lettered_and_visible(
    store: Store, merchant: Receiver
) -> None:
    merchant.status = 410
    with store.engine.begin() as conn:
        (refused,) = stage(conn, Message("order.paid", "order", "o-1", {"n": 1}), tenant_id="t1")
    sink = WebhookSink({"t1": WebhookEndpoint(merchant.url, SECRET)}, deadline=timedelta(seconds=1))
    policy = RelayPolicy(max_attempts=3, backoff_base=1.0, concurrency=1)
    with Relay(store, {"default": sink}, policy=policy, rand=lambda: 0.0) as relay:
        for _ in range(10):  # passes until nothing is due (rand=0: a failure is due at once)
            if relay.drain().leased == 0:
                break
        dead = find(store, refused)
        assert (dead.state, dead.attempts, dead.last_error) == ("dead", 3, "http_410")
        assert merchant.requests == 3  # one request per attempt, then never again
        assert [m.id for m in messages(store, state="dead")] == [refused]
        # The endpoint fixed, a new message goes through, and is applied once.
        merchant.status = 200
        with store.engine.begin() as conn:
            (fine,) = stage(conn, Message("order.paid", "order", "o-2", {"n": 2}), tenant_id="t1")
        assert relay.drain().delivered == 1
    assert find(store, fine).state == "delivered"
    assert merchant.applied == {fine: {"n": 2}}
