"""Request building: a payorch operation's payload as an Adyen Checkout JSON body.

Pure functions; :class:`InvalidPayload` means the payload lacks what Adyen needs, and the
adapter refuses the operation before sending anything (``invalid_request``).

=================  =====================================================================
operation          Adyen call
=================  =====================================================================
payment.create     ``POST /payments``, ``reference`` = the downstream key
payment.capture    ``POST /payments/{payload["payment_intent"]}/captures``
refund.create      ``POST /payments/{payload["payment_intent"]}/refunds``
void               ``POST /payments/{provider_reference}/cancels``, or without a
                   reference ``POST /cancels`` with ``paymentReference`` = the downstream key
=================  =====================================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigurationError
from ...provider import TAG_KEY, TAG_LEGACY_OPERATION_ID, SubmitRequest, VoidRequest
from ._classify import PAYMENT_CAPTURE, PAYMENT_CREATE, SUPPORTED_OPERATIONS

__all__ = [
    "MAX_IDEMPOTENCY_KEY",
    "MAX_REFERENCE",
    "PSP_REFERENCE",
    "Call",
    "InvalidPayload",
    "require_supported",
    "submit_call",
    "void_call",
]

MAX_IDEMPOTENCY_KEY = 64  # Adyen's limit for Idempotency-Key
MAX_REFERENCE = 80  # Adyen's limit for a merchant reference
# Adyen's pspReference: 16 alphanumerics today; nothing else may reach a URL path.
PSP_REFERENCE = re.compile(r"[A-Za-z0-9]{1,64}")
_CURRENCY = re.compile(r"[A-Za-z]{3}")
_CAPTURE_METHODS = frozenset({"automatic", "manual"})
# payorch's refund reasons (Stripe's words among them) as Adyen's merchantRefundReason.
_REFUND_REASONS = {
    "duplicate": "DUPLICATE",
    "fraudulent": "FRAUD",
    "fraud": "FRAUD",
    "requested_by_customer": "CUSTOMER REQUEST",
    "customer request": "CUSTOMER REQUEST",
    "return": "RETURN",
    "other": "OTHER",
}


class InvalidPayload(Exception):
    """The payload lacks what Adyen needs; refused locally, before anything is sent."""


@dataclass(frozen=True, kw_only=True)
class Call:
    """One POST the adapter sends: its path (below the base URL), JSON body and key."""

    path: str
    json: dict[str, Any]
    idempotency_key: str


def _optional_text(payload: Mapping[str, Any], name: str) -> str | None:
    value = payload.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidPayload(f"payload[{name!r}] must be a non-empty string")
    return value


def _amount(payload: Mapping[str, Any], name: str) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    # Minor units only: floats and bools are refused, never rounded.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidPayload(f"payload[{name!r}] must be an integer >= 1 (minor units)")
    return value


def _money(value: int | None, currency: str | None, what: str) -> dict[str, Any]:
    if value is None:
        raise InvalidPayload(f"Adyen needs the amount of a {what}")
    if currency is None:
        raise InvalidPayload(
            f"Adyen needs the currency of a {what}: give payload['currency'] or the "
            "adapter's default_currency"
        )
    if not _CURRENCY.fullmatch(currency):
        raise InvalidPayload(f"currency {currency!r} is not a three-letter ISO 4217 code")
    return {"value": value, "currency": currency.upper()}


def _key(key: str, what: str) -> str:
    if not key or len(key) > MAX_IDEMPOTENCY_KEY or not key.isascii():
        raise InvalidPayload(f"the {what} key {key!r} is not an Adyen Idempotency-Key (≤ 64)")
    return key


def _reference(key: str) -> str:
    if len(key) > MAX_REFERENCE:
        raise InvalidPayload(f"the downstream key {key!r} is longer than Adyen's reference")
    return key


def _psp(value: object, name: str) -> str:
    if not isinstance(value, str) or not PSP_REFERENCE.fullmatch(value):
        raise InvalidPayload(f"{name} must be an Adyen pspReference (alphanumeric)")
    return value


# Adyen's metadata limits: at most 20 entries, keys of 20 characters, values of 80.
MAX_METADATA = 20
MAX_METADATA_KEY = 20
MAX_METADATA_VALUE = 80
# payorch's tags under keys Adyen can hold (payorch_idempotency_key is 23 characters).
_TAG_KEYS = {TAG_KEY: "payorch_key"}


def _metadata(request: SubmitRequest) -> dict[str, str]:
    """The caller's metadata (if any) and payorch's tags; ours come last and win.

    The caller's entries must fit Adyen's limits (refused before sending otherwise); a tag
    whose value does not fit (a client key over 80 characters) is left out: the reference
    (the downstream key) is what finds the payment again, the tags only explain it.
    """
    out: dict[str, str] = {}
    extra = request.payload.get("metadata")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise InvalidPayload("payload['metadata'] must be a mapping of strings")
        for key, value in extra.items():
            if not isinstance(key, str) or not key or not isinstance(value, str):
                raise InvalidPayload(f"metadata[{key!r}] must be a string under a string key")
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise InvalidPayload(
                    f"metadata[{key!r}]: Adyen holds keys of at most {MAX_METADATA_KEY} "
                    f"characters and values of at most {MAX_METADATA_VALUE}"
                )
            if not key.startswith("payorch_"):
                out[key] = value
    tags = dict(request.tags)
    if TAG_LEGACY_OPERATION_ID in tags:
        tags["payorch_operation"] = request.operation
    for key, value in tags.items():
        if len(value) <= MAX_METADATA_VALUE:
            out[_TAG_KEYS.get(key, key)] = value
    if len(out) > MAX_METADATA:
        raise InvalidPayload(f"Adyen holds at most {MAX_METADATA} metadata entries, not {len(out)}")
    return out


def _payment_method(value: object) -> dict[str, Any]:
    if value is None:
        raise InvalidPayload("Adyen needs a payment method (payload['payment_method'])")
    if isinstance(value, Mapping):
        if not isinstance(value.get("type"), str):
            raise InvalidPayload("payload['payment_method'] as an object needs a 'type'")
        return dict(value)
    if isinstance(value, str) and value:
        # A token of a stored card: Adyen's storedPaymentMethodId.
        return {"type": "scheme", "storedPaymentMethodId": value}
    raise InvalidPayload("payload['payment_method'] must be a stored method id or an object")


def _payment(request: SubmitRequest, merchant_account: str, return_url: str | None) -> Call:
    payload = request.payload
    currency = _optional_text(payload, "currency")
    capture_method = _optional_text(payload, "capture_method") or "automatic"
    if capture_method not in _CAPTURE_METHODS:
        raise InvalidPayload(f"capture_method {capture_method!r} is not one Adyen knows")
    body: dict[str, Any] = {
        "amount": _money(_amount(payload, "amount"), currency, "payment"),
        "reference": _reference(request.downstream_key),
        "merchantAccount": merchant_account,
        "paymentMethod": _payment_method(payload.get("payment_method")),
    }
    url = _optional_text(payload, "return_url") or return_url
    if url is not None:
        body["returnUrl"] = url
    customer = _optional_text(payload, "customer")
    if customer is not None:
        body["shopperReference"] = customer
    if "storedPaymentMethodId" in body["paymentMethod"]:
        body["shopperInteraction"] = "ContAuth"
        body["recurringProcessingModel"] = "UnscheduledCardOnFile"
    description = _optional_text(payload, "description")
    if description is not None:
        body["shopperStatement"] = description
    if capture_method == "manual":
        # The authorisation is the effect; capturing is a separate payment.capture.
        body["additionalData"] = {"manualCapture": "true"}
    metadata = _metadata(request)
    if metadata:
        body["metadata"] = metadata
    return Call(
        path="/payments", json=body, idempotency_key=_key(request.downstream_key, "downstream")
    )


def submit_call(
    request: SubmitRequest,
    *,
    merchant_account: str,
    return_url: str | None = None,
    default_currency: str | None = None,
) -> Call:
    """The Adyen call for ``request``; raises InvalidPayload (and ConfigurationError for an
    operation the adapter does not support)."""
    require_supported(request.operation)
    if request.operation == PAYMENT_CREATE:
        return _payment(request, merchant_account, return_url)
    payload = request.payload
    psp = _psp(payload.get("payment_intent"), "payload['payment_intent']")
    currency = _optional_text(payload, "currency") or default_currency
    key = _key(request.downstream_key, "downstream")
    if request.operation == PAYMENT_CAPTURE:
        amount = _amount(payload, "amount_to_capture") or _amount(payload, "amount")
        body: dict[str, Any] = {
            "merchantAccount": merchant_account,
            "amount": _money(amount, currency, "capture"),
            "reference": _reference(request.downstream_key),
        }
        return Call(path=f"/payments/{psp}/captures", json=body, idempotency_key=key)
    # refund.create
    body = {
        "merchantAccount": merchant_account,
        "amount": _money(_amount(payload, "amount"), currency, "refund"),
        "reference": _reference(request.downstream_key),
    }
    reason = _optional_text(payload, "reason")
    if reason is not None and reason.lower() in _REFUND_REASONS:
        body["merchantRefundReason"] = _REFUND_REASONS[reason.lower()]
    return Call(path=f"/payments/{psp}/refunds", json=body, idempotency_key=key)


def void_call(request: VoidRequest, *, merchant_account: str) -> Call:
    """The cancel for ``request``: by the payment's pspReference when it is known, else by
    its merchant reference (our downstream key: a technical cancel). Its own key is
    ``request.void_key``, which is also its ``reference``."""
    if request.operation != PAYMENT_CREATE:
        raise ConfigurationError(
            f"the Adyen adapter voids payment.create operations, not {request.operation!r}"
        )
    key = _key(request.void_key, "void")
    if request.provider_reference:
        psp = _psp(request.provider_reference, "the provider reference")
        body = {"merchantAccount": merchant_account, "reference": _reference(key)}
        return Call(path=f"/payments/{psp}/cancels", json=body, idempotency_key=key)
    body = {
        "merchantAccount": merchant_account,
        "paymentReference": _reference(request.downstream_key),
        "reference": _reference(key),
    }
    return Call(path="/cancels", json=body, idempotency_key=key)


def require_supported(operation: str) -> None:
    if operation not in SUPPORTED_OPERATIONS:
        supported = ", ".join(sorted(SUPPORTED_OPERATIONS))
        raise ConfigurationError(
            f"the Adyen adapter does not support operation {operation!r} (it supports {supported})"
        )
