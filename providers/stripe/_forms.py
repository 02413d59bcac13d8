"""Request building: a payorch operation's payload as Stripe form fields.

Pure functions; :class:`InvalidPayload` means the payload lacks what Stripe needs, and the
adapter refuses the operation before sending anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from ...errors import ConfigurationError
from ...provider import TAG_LEGACY_OPERATION_ID, TAG_REF, SubmitRequest
from ._classify import PAYMENT_CAPTURE, PAYMENT_CREATE, SUPPORTED_OPERATIONS

__all__ = [
    "STRIPE_ID",
    "InvalidPayload",
    "payment_intent_of",
    "require_supported",
    "search_query",
    "submit_call",
]

STRIPE_ID = re.compile(r"[A-Za-z0-9_]{1,255}")  # Stripe ids; nothing else may reach a URL path
_CAPTURE_METHODS = frozenset({"automatic", "automatic_async", "manual"})
_CURRENCY = re.compile(r"[A-Za-z]{3}")

_T = TypeVar("_T")


class InvalidPayload(Exception):
    """The payload lacks what Stripe needs; refused locally, before anything is sent."""


def _optional_text(payload: Mapping[str, Any], name: str) -> str | None:
    value = payload.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidPayload(f"payload[{name!r}] must be a non-empty string")
    return value


def _optional_amount(payload: Mapping[str, Any], name: str, *, minimum: int = 1) -> str | None:
    value = payload.get(name)
    if value is None:
        return None
    # Minor units only: floats and bools are refused, never rounded.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidPayload(f"payload[{name!r}] must be an integer >= {minimum} (minor units)")
    return str(value)


def _required(value: _T | None, name: str) -> _T:
    if value is None:
        raise InvalidPayload(f"payload[{name!r}] is required")
    return value


def payment_intent_of(payload: Mapping[str, Any]) -> str:
    value = _required(_optional_text(payload, "payment_intent"), "payment_intent")
    if not value.startswith("pi_") or not STRIPE_ID.fullmatch(value):
        raise InvalidPayload("payload['payment_intent'] must be a PaymentIntent id (pi_…)")
    return value


def _metadata(request: SubmitRequest) -> dict[str, str]:
    """Form fields of the caller's metadata (if any) and ours, Stripe-style: metadata[key]=value.

    Our payorch_* keys come last and win: status queries and webhooks find effects by them.
    """
    form: dict[str, str] = {}
    extra = request.payload.get("metadata")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise InvalidPayload("payload['metadata'] must be a mapping of strings")
        for key, value in extra.items():
            # Stripe forbids brackets in metadata keys; they would also break the encoding.
            if not isinstance(key, str) or not key or "[" in key or "]" in key:
                raise InvalidPayload(f"metadata key {key!r} is not one Stripe accepts")
            if not isinstance(value, str):
                raise InvalidPayload(f"metadata[{key!r}] must be a string")
            if not key.startswith("payorch_"):
                form[f"metadata[{key}]"] = value
    # From the namespace alone (payorch.provider.provider_tags): a claim re-created after a
    # failover sends byte for byte the same form, and Stripe's idempotency answers it.
    for key, value in request.tags.items():
        form[f"metadata[{key}]"] = value
    if TAG_LEGACY_OPERATION_ID in request.tags:
        form["metadata[payorch_operation]"] = request.operation  # as those were first sent
    return form


def own_tag(tags: Mapping[str, str]) -> tuple[str, str]:
    """The metadata key and value that mark an operation's own Stripe objects."""
    if TAG_REF in tags:
        return TAG_REF, tags[TAG_REF]
    return TAG_LEGACY_OPERATION_ID, tags[TAG_LEGACY_OPERATION_ID]


def submit_call(request: SubmitRequest) -> tuple[str, dict[str, str]]:
    """Path and form fields of the Stripe call for ``request``; raises InvalidPayload."""
    payload = request.payload
    form: dict[str, str] = {}
    if request.operation == PAYMENT_CREATE:
        currency = _required(_optional_text(payload, "currency"), "currency")
        if not _CURRENCY.fullmatch(currency):
            raise InvalidPayload("payload['currency'] must be a three-letter ISO 4217 code")
        capture_method = _optional_text(payload, "capture_method") or "automatic"
        if capture_method not in _CAPTURE_METHODS:
            raise InvalidPayload(f"capture_method {capture_method!r} is not one Stripe knows")
        form["amount"] = _required(_optional_amount(payload, "amount"), "amount")
        form["currency"] = currency.lower()
        for name in ("customer", "payment_method", "description", "return_url"):
            value = _optional_text(payload, name)
            if value is not None:
                form[name] = value
        form["confirm"] = "true"
        form["capture_method"] = capture_method
        form.update(_metadata(request))
        return "/v1/payment_intents", form
    if request.operation == PAYMENT_CAPTURE:
        intent = payment_intent_of(payload)
        # Stripe decides whether a zero capture is acceptable; the model allows it.
        amount = _optional_amount(payload, "amount_to_capture", minimum=0)
        if amount is not None:
            form["amount_to_capture"] = amount
        return f"/v1/payment_intents/{intent}/capture", form
    # refund.create: the caller has checked the operation is supported.
    form["payment_intent"] = payment_intent_of(payload)
    amount = _optional_amount(payload, "amount")
    if amount is not None:
        form["amount"] = amount
    reason = _optional_text(payload, "reason")
    if reason is not None:
        form["reason"] = reason  # Stripe validates its enum (duplicate, fraudulent, ...)
    form.update(_metadata(request))
    return "/v1/refunds", form


def require_supported(operation: str) -> None:
    if operation not in SUPPORTED_OPERATIONS:
        supported = ", ".join(sorted(SUPPORTED_OPERATIONS))
        raise ConfigurationError(
            f"the Stripe adapter does not support operation {operation!r} (it supports {supported})"
        )


def search_query(tag: tuple[str, str]) -> str:
    # Search query language: single-quoted value, backslash escapes quote and backslash.
    name, value = tag
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"metadata['{name}']:'{escaped}'"
