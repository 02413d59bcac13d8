"""Stripe-shaped bodies, requests and status queries shared by the Stripe adapter's tests,
and their fixtures (a pytest plugin, registered in conftest.py): ``router``, the respx router
a test answers through, and ``stripe``, a :class:`StripeProvider` over it.

The bodies follow Stripe's documented replies; the tests serve them through respx.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import respx

from payorch.core import downstream_key, namespace_ref
from payorch.provider import StatusQuery, SubmitRequest
from payorch.providers.stripe import StripeProvider

BASE = "https://api.stripe.test"
API_KEY = "sk_test_4eC39HqLyjWDarjtT1zdp7dc"
SECRET = "whsec_test_5ZyGQ0lqYzbw0sNLDXNkKfd2TzQ4n7Xh"
OP_ID = "0192c0de-7a1b-7c3d-8e4f-5a6b7c8d9e0f"
TENANT = "tenant-a"
# A downstream key of the earlier form (payorch:<operation id>:…): such operations keep the
# metadata they were first sent with (payorch_operation_id). Today's form: NS_KEY below.
KEY = "payorch:0192c0de-7a1b-7c3d-8e4f-5a6b7c8d9e0f:1"
NS_KEY = downstream_key(namespace_ref(TENANT, "payment.create", "order-17"))
NS_REF = NS_KEY.split(":")[1]
PI_ID = "pi_3MtwBwLkdIwHu7ix28a3tqPa"
RE_ID = "re_1Nispe2eZvKYlo2Cd31jOCgZ"


# -- fixtures (a test module may define its own of either name) ----------------------------------


@pytest.fixture
def router() -> respx.Router:
    return respx.Router(base_url=BASE, assert_all_called=False)


@pytest.fixture
def stripe(router: respx.Router) -> Iterator[StripeProvider]:
    with StripeProvider(
        api_key=API_KEY,
        webhook_secret=SECRET,
        base_url=BASE,
        transport=httpx.MockTransport(router.handler),
    ) as provider:
        yield provider


# -- Stripe-shaped bodies ----------------------------------------------------------------------


def payment_intent(
    status: str = "succeeded",
    *,
    ident: str = PI_ID,
    operation_id: str = OP_ID,
    capture_method: str = "automatic",
    last_payment_error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "payment_intent",
        "amount": 2000,
        "amount_capturable": 2000 if status == "requires_capture" else 0,
        "amount_received": 2000 if status == "succeeded" else 0,
        "automatic_payment_methods": None,
        "canceled_at": None,
        "cancellation_reason": None,
        "capture_method": capture_method,
        "client_secret": f"{ident}_secret_YrKJUKribcBjcG8HVhfZluoGH",
        "confirmation_method": "automatic",
        "created": 1680800504,
        "currency": "usd",
        "customer": "cus_NffrFeUfNV2Hib",
        "description": None,
        "last_payment_error": last_payment_error,
        "latest_charge": "ch_3MtwBwLkdIwHu7ix28a3tqPa",
        "livemode": False,
        "metadata": {
            "payorch_operation": "payment.create",
            "payorch_operation_id": operation_id,
            "payorch_tenant_id": TENANT,
        },
        "next_action": None,
        "payment_method": "pm_1MtwBwLkdIwHu7ixvZ0NQ8mJ",
        "payment_method_types": ["card"],
        "status": status,
    }


def refund(
    status: str = "succeeded", *, ident: str = RE_ID, operation_id: str = OP_ID
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "refund",
        "amount": 1000,
        "balance_transaction": "txn_1Nispe2eZvKYlo2CYezqFhEx",
        "charge": "ch_1NirD82eZvKYlo2CIvbtLWuY",
        "created": 1692942318,
        "currency": "usd",
        "failure_reason": "expired_or_canceled_card" if status == "failed" else None,
        "metadata": {
            "payorch_operation": "refund.create",
            "payorch_operation_id": operation_id,
            "payorch_tenant_id": TENANT,
        },
        "payment_intent": PI_ID,
        "reason": None,
        "receipt_number": None,
        "source_transfer_reversal": None,
        "status": status,
        "transfer_reversal": None,
    }


def stripe_error(
    error_type: str, message: str, *, code: str | None = None, **extra: Any
) -> dict[str, Any]:
    err: dict[str, Any] = {"type": error_type, "message": message}
    if code is not None:
        err["code"] = code
        err["doc_url"] = f"https://stripe.com/docs/error-codes/{code.replace('_', '-')}"
    err["request_log_url"] = "https://dashboard.stripe.com/test/logs/req_xyz?t=1680800504"
    err.update(extra)
    return {"error": err}


def create_request(**payload: Any) -> SubmitRequest:
    body = {"amount": 2000, "currency": "USD", "payment_method": "pm_card_visa"} | payload
    return SubmitRequest(
        tenant_id=TENANT,
        operation="payment.create",
        operation_id=OP_ID,
        downstream_key=KEY,
        payload=body,
    )


def query(
    operation: str = "payment.create", reference: str | None = PI_ID, **payload: Any
) -> StatusQuery:
    return StatusQuery(
        tenant_id=TENANT,
        operation=operation,
        operation_id=OP_ID,
        downstream_key=KEY,
        provider_reference=reference,
        payload=payload,
    )


def search_result(*intents: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "search_result",
        "url": "/v1/payment_intents/search",
        "has_more": False,
        "data": list(intents),
        "next_page": None,
    }
