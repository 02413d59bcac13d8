"""The Adyen adapter's request shapes and the classification of Adyen's replies (respx)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import respx

from payorch.core import downstream_key, namespace_ref
from payorch.errors import ConfigurationError
from payorch.outcome import REFUSED_BEFORE_SENDING
from payorch.provider import (
    TAG_KEY,
    AnswerKind,
    Capability,
    StatusQuery,
    SubmitRequest,
    VoidRequest,
    can_query_status,
    can_void,
    capabilities_of,
)
from payorch.providers.adyen import IDEMPOTENCY_WINDOW, RESULT_CODES, AdyenProvider

BASE = "https://checkout.adyen.test/v71"
API_KEY = "AQE_test_key"
MERCHANT = "PayorchECOM"
HMAC = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
TENANT = "tenant-a"
KEY = downstream_key(namespace_ref(TENANT, "payment.create", "order-17"))
PSP = "993617895204576J"
CAPTURE_PSP = "993617894906488A"


@pytest.fixture
def router() -> respx.Router:
    return respx.Router(base_url=BASE, assert_all_called=False)


@pytest.fixture
def adyen(router: respx.Router) -> Iterator[AdyenProvider]:
    transport = httpx.MockTransport(router.handler)
    with AdyenProvider(
        api_key=API_KEY,
        merchant_account=MERCHANT,
        hmac_key=HMAC,
        base_url=BASE,
        return_url="https://shop.invalid/return",
        default_currency="EUR",
        transport=transport,
        async_transport=httpx.MockTransport(router.async_handler),
    ) as provider:
        yield provider


def submit(operation: str = "payment.create", **payload: Any) -> SubmitRequest:
    key = downstream_key(namespace_ref(TENANT, operation, "order-17"))
    base: dict[str, Any] = {
        "payment.create": {"amount": 1000, "currency": "EUR", "payment_method": "8315"},
        "payment.capture": {"payment_intent": PSP, "amount_to_capture": 1000},
        "refund.create": {"payment_intent": PSP, "amount": 500, "currency": "EUR"},
    }[operation]
    return SubmitRequest(
        tenant_id=TENANT,
        operation=operation,
        operation_id="op-1",
        downstream_key=key,
        payload={**base, **payload},
        idempotency_key="order-17",
    )


def void(reference: str | None = None) -> VoidRequest:
    return VoidRequest(
        tenant_id=TENANT,
        operation="payment.create",
        operation_id="op-1",
        downstream_key=KEY,
        provider_reference=reference,
    )


def error(status: int, code: str, message: str = "x", **headers: str) -> httpx.Response:
    body = {"status": status, "errorCode": code, "message": message, "errorType": "validation"}
    return httpx.Response(
        status, json=body, headers={k.replace("_", "-"): v for k, v in headers.items()}
    )


def payment(result: str, **extra: Any) -> httpx.Response:
    return httpx.Response(200, json={"pspReference": PSP, "resultCode": result, **extra})


# -- what the adapter declares -------------------------------------------------------------


def test_declares_replay_void_and_webhooks_but_no_status(adyen: AdyenProvider) -> None:
    assert capabilities_of(adyen) == {
        Capability.REPLAY,
        Capability.VOID_BY_KEY,
        Capability.VOID_BY_REFERENCE,
        Capability.WEBHOOKS,
    }
    assert not can_query_status(adyen) and can_void(adyen, None)
    assert adyen.name == "adyen" and adyen.idempotency_window == IDEMPOTENCY_WINDOW
    assert adyen.idempotency_window.days == 31
    assert adyen.max_call_duration.total_seconds() == 50.0  # every time-out phase


@pytest.mark.parametrize("key", ["", "zz", "abc", "44782DEF547AAA0G"])
def test_a_hmac_key_that_is_not_hex_is_refused_at_construction(key: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        AdyenProvider(api_key=API_KEY, merchant_account=MERCHANT, hmac_key=key, base_url=BASE)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "settings",
    [
        {"api_key": ""},
        {"merchant_account": " "},
        {"base_url": "ftp://x"},
        {"default_currency": "E"},
    ],
)
def test_other_bad_settings_are_refused(settings: dict[str, str]) -> None:
    base = {"api_key": API_KEY, "merchant_account": MERCHANT, "base_url": BASE, **settings}
    with pytest.raises(ConfigurationError):
        AdyenProvider(**base)


def test_status_is_not_asked_over_http(adyen: AdyenProvider, router: respx.Router) -> None:
    query = StatusQuery(
        tenant_id=TENANT,
        operation="payment.create",
        operation_id="op-1",
        downstream_key=KEY,
        provider_reference=PSP,
    )
    answer = adyen.query_status(query)
    assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "status_unsupported")
    assert asyncio.run(adyen.aquery_status(query)) == answer
    assert router.calls.call_count == 0


# -- request shapes ------------------------------------------------------------------------


def test_a_payment_carries_the_key_as_idempotency_key_and_reference(
    adyen: AdyenProvider, router: respx.Router
) -> None:
    route = router.post("/payments").mock(return_value=payment("Authorised"))
    request = submit(customer="shopper-1", metadata={"order": "17"})
    adyen.submit(request)
    sent = route.calls.last.request
    assert sent.headers["X-API-Key"] == API_KEY
    assert sent.headers["Idempotency-Key"] == request.downstream_key
    body = json.loads(sent.content)
    assert body["reference"] == request.downstream_key
    assert body["merchantAccount"] == MERCHANT
    assert body["amount"] == {"value": 1000, "currency": "EUR"}
    assert body["paymentMethod"] == {"type": "scheme", "storedPaymentMethodId": "8315"}
    assert body["shopperReference"] == "shopper-1"
    assert body["returnUrl"] == "https://shop.invalid/return"
    tags = {("payorch_key" if k == TAG_KEY else k): v for k, v in request.tags.items()}
    assert body["metadata"] == {"order": "17", **tags}
    assert all(len(k) <= 20 and len(v) <= 80 for k, v in body["metadata"].items())
    assert "additionalData" not in body  # automatic capture: Adyen's default


def test_metadata_fits_adyens_limits(adyen: AdyenProvider, router: respx.Router) -> None:
    route = router.post("/payments").mock(return_value=payment("Authorised"))
    # A client key longer than Adyen holds: its tag is left out, the reference stays.
    request = dataclasses.replace(submit(), idempotency_key="k" * 120)
    adyen.submit(request)
    body = json.loads(route.calls.last.request.content)
    assert "payorch_key" not in body["metadata"]
    assert body["reference"] == request.downstream_key
    # The caller's own entries that do not fit are refused before anything is sent.
    for metadata in ({"k" * 21: "v"}, {"order": "v" * 81}, {f"m{i}": "v" for i in range(20)}):
        answer = adyen.submit(submit(metadata=metadata))
        assert answer.kind is AnswerKind.NOT_SENT and answer.code == "invalid_request"
    assert route.call_count == 1


def test_manual_capture_asks_adyen_for_it(adyen: AdyenProvider, router: respx.Router) -> None:
    route = router.post("/payments").mock(return_value=payment("Authorised"))
    adyen.submit(submit(capture_method="manual"))
    assert json.loads(route.calls.last.request.content)["additionalData"] == {
        "manualCapture": "true"
    }


def test_capture_and_refund_go_to_the_payment_they_modify(
    adyen: AdyenProvider, router: respx.Router
) -> None:
    received = {"pspReference": CAPTURE_PSP, "paymentPspReference": PSP, "status": "received"}
    capture = router.post(f"/payments/{PSP}/captures").mock(httpx.Response(201, json=received))
    refund = router.post(f"/payments/{PSP}/refunds").mock(httpx.Response(201, json=received))
    answer = adyen.submit(submit("payment.capture"))
    assert (answer.kind, answer.provider_reference) == (AnswerKind.PENDING, CAPTURE_PSP)
    body = json.loads(capture.calls.last.request.content)
    assert body["amount"] == {"value": 1000, "currency": "EUR"}  # the default currency
    assert body["reference"] == capture.calls.last.request.headers["Idempotency-Key"]
    assert adyen.submit(submit("refund.create", reason="duplicate")).kind is AnswerKind.PENDING
    sent = json.loads(refund.calls.last.request.content)
    assert sent["merchantRefundReason"] == "DUPLICATE" and sent["amount"]["value"] == 500


@pytest.mark.parametrize(
    ("operation", "payload"),
    [
        ("payment.create", {"payment_method": None}),
        ("payment.create", {"amount": 10.5}),
        ("payment.capture", {"payment_intent": "../../x"}),
        ("payment.capture", {"amount_to_capture": None}),
    ],
)
def test_a_payload_adyen_cannot_take_is_refused_before_sending(
    adyen: AdyenProvider, router: respx.Router, operation: str, payload: dict[str, Any]
) -> None:
    answer = adyen.submit(submit(operation, **payload))
    assert answer.kind is AnswerKind.NOT_SENT and answer.code in REFUSED_BEFORE_SENDING
    assert router.calls.call_count == 0


def test_an_unsupported_operation_is_a_configuration_error(adyen: AdyenProvider) -> None:
    request = SubmitRequest(
        tenant_id=TENANT,
        operation="payout.create",
        operation_id="o",
        downstream_key=KEY,
        payload={},
    )
    with pytest.raises(ConfigurationError):
        adyen.submit(request)


def test_a_void_by_reference_and_by_key(adyen: AdyenProvider, router: respx.Router) -> None:
    by_psp = router.post(f"/payments/{PSP}/cancels").mock(
        httpx.Response(
            201, json={"pspReference": "C1", "paymentPspReference": PSP, "status": "received"}
        )
    )
    by_key = router.post("/cancels").mock(
        httpx.Response(
            201, json={"pspReference": "C2", "paymentReference": KEY, "status": "received"}
        )
    )
    answer = adyen.void(void(PSP))
    assert (answer.kind, answer.provider_reference) == (AnswerKind.PENDING, PSP)
    sent = by_psp.calls.last.request
    assert sent.headers["Idempotency-Key"] == void().void_key
    assert json.loads(sent.content) == {"merchantAccount": MERCHANT, "reference": void().void_key}
    assert adyen.void(void()).kind is AnswerKind.PENDING
    body = json.loads(by_key.calls.last.request.content)
    assert body == {
        "merchantAccount": MERCHANT,
        "paymentReference": KEY,
        "reference": void().void_key,
    }


def test_a_payment_that_cannot_be_cancelled_is_a_declined_void(
    adyen: AdyenProvider, router: respx.Router
) -> None:
    router.post(f"/payments/{PSP}/cancels").mock(error(422, "167", "cannot be cancelled"))
    answer = adyen.void(void(PSP))
    assert (answer.kind, answer.code) == (AnswerKind.DECLINED, "167")


# -- classification ------------------------------------------------------------------------


@pytest.mark.parametrize(("result", "kind"), sorted(RESULT_CODES.items()))
def test_every_result_code(
    adyen: AdyenProvider, router: respx.Router, result: str, kind: AnswerKind
) -> None:
    router.post("/payments").mock(payment(result, refusalReason="Not enough balance"))
    answer = adyen.submit(submit())
    assert (answer.kind, answer.provider_reference) == (kind, PSP)
    if kind is AnswerKind.DECLINED:
        assert answer.code == "Not enough balance"


def test_the_table_follows_adyens_final_states() -> None:
    assert RESULT_CODES["Authorised"] is AnswerKind.SUCCEEDED
    assert {c for c, k in RESULT_CODES.items() if k is AnswerKind.DECLINED} == {
        "Refused",
        "Error",
        "Cancelled",
    }
    assert RESULT_CODES["Received"] is RESULT_CODES["PresentToShopper"] is AnswerKind.PENDING


@pytest.mark.parametrize("result", ["Success", "PartiallyAuthorised", "SomethingNew"])
def test_an_undocumented_result_code_is_no_outcome(
    adyen: AdyenProvider, router: respx.Router, result: str
) -> None:
    router.post("/payments").mock(payment(result))
    answer = adyen.submit(submit())
    assert answer.kind is AnswerKind.AMBIGUOUS and answer.code == f"unexpected_result:{result}"


@pytest.mark.parametrize("status", [409, 422])
def test_704_with_transient_error_is_possibly_sent_and_retried_later(
    adyen: AdyenProvider, router: respx.Router, status: int
) -> None:
    # The key's first request is still being processed: it may move money; the same key
    # (a replay) answers it later. Never "not sent".
    router.post("/payments").mock(error(status, "704", Transient_Error="true", Retry_After="3"))
    answer = adyen.submit(submit())
    assert (answer.kind, answer.code, answer.retry_after) == (AnswerKind.AMBIGUOUS, "704", 3.0)


@pytest.mark.parametrize("status", [409, 422])
def test_704_without_transient_error_is_ambiguous(
    adyen: AdyenProvider, router: respx.Router, status: int
) -> None:
    router.post("/payments").mock(error(status, "704"))
    answer = adyen.submit(submit())
    assert (answer.kind, answer.code) == (AnswerKind.AMBIGUOUS, "704")


@pytest.mark.parametrize(
    ("reply", "kind", "code"),
    [
        (error(400, "702"), AnswerKind.DECLINED, "702"),
        (error(422, "14_030", "Return URL is missing."), AnswerKind.DECLINED, "14_030"),
        (error(401, "000"), AnswerKind.NOT_SENT, "provider_auth_failed"),
        (error(403, "901"), AnswerKind.NOT_SENT, "provider_auth_failed"),
        (error(429, "429"), AnswerKind.NOT_SENT, "rate_limited"),
        (error(500, "905"), AnswerKind.AMBIGUOUS, "http_500"),
        (error(503, "703", Transient_Error="true"), AnswerKind.AMBIGUOUS, "703"),
        (error(500, "905", Transient_Error="true"), AnswerKind.AMBIGUOUS, "905"),
        (error(429, "429", Transient_Error="true"), AnswerKind.NOT_SENT, "rate_limited"),
        (error(404, "000"), AnswerKind.AMBIGUOUS, "000"),
        (httpx.Response(502, text="<html>bad gateway</html>"), AnswerKind.AMBIGUOUS, "http_502"),
        (httpx.Response(418, text="teapot"), AnswerKind.AMBIGUOUS, "http_418"),
        (httpx.Response(200, json={"no": "resultCode"}), AnswerKind.AMBIGUOUS, "unexpected_body"),
    ],
)
def test_errors(
    adyen: AdyenProvider, router: respx.Router, reply: httpx.Response, kind: AnswerKind, code: str
) -> None:
    router.post("/payments").mock(reply)
    answer = adyen.submit(submit())
    assert (answer.kind, answer.code) == (kind, code)


def test_a_modification_received_is_pending_until_its_notification(
    adyen: AdyenProvider, router: respx.Router
) -> None:
    router.post(f"/payments/{PSP}/captures").mock(httpx.Response(201, json={"status": "other"}))
    assert adyen.submit(submit("payment.capture")).code == "unexpected_body"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (httpx.ConnectError("refused"), AnswerKind.NOT_SENT),
        (httpx.ReadTimeout("slow"), AnswerKind.AMBIGUOUS),
    ],
)
def test_transport_errors(
    adyen: AdyenProvider, router: respx.Router, error: Exception, kind: AnswerKind
) -> None:
    router.post("/payments").mock(side_effect=error)
    assert adyen.submit(submit()).kind is kind


# -- async mirrors -------------------------------------------------------------------------


def test_async_calls_answer_as_the_sync_ones(adyen: AdyenProvider, router: respx.Router) -> None:
    router.post("/payments").mock(
        side_effect=[payment("Refused", refusalReason="CVC Declined")] * 2
    )
    router.post("/cancels").mock(error(409, "704", Transient_Error="true"))
    router.post(f"/payments/{PSP}/captures").mock(
        httpx.Response(201, json={"pspReference": CAPTURE_PSP, "status": "received"})
    )

    async def both() -> list[Any]:
        return [
            await adyen.asubmit(submit()),
            await adyen.avoid(void()),
            await adyen.asubmit(submit("payment.capture")),
        ]

    sync = [adyen.submit(submit()), adyen.void(void()), adyen.submit(submit("payment.capture"))]
    assert asyncio.run(both()) == sync
    assert [a.kind for a in sync] == [AnswerKind.DECLINED, AnswerKind.AMBIGUOUS, AnswerKind.PENDING]
    assert sync[0].code == "CVC Declined"
