"""Adyen standard notifications: HMAC verification of every item, and their evidence.

A delivery is ``{"live": "false", "notificationItems": [{"NotificationRequestItem":
{...}}, ...]}``. Each item carries its own signature in ``additionalData.hmacSignature``:
Base64 of HMAC-SHA256, keyed with the hex-decoded HMAC key, over the eight fields
``pspReference:originalReference:merchantAccountCode:merchantReference:value:currency:
eventCode:success`` joined by ``:`` (a missing field is an empty string, nothing escaped).
Every item is verified, in constant time; one that fails is a rejected item, not a
rejected delivery. So is a verified item whose ``merchantAccountCode`` is not the adapter's
merchant account (another account's, under a webhook set up at company level). The answer
Adyen expects once every item was taken is ``[accepted]``.

Items become :class:`WebhookEvent` s for the operation they settle:

================================  ===========================================================
eventCode (success)               evidence
================================  ===========================================================
AUTHORISATION (true / false)      payment.create SUCCEEDED / DECLINED (code: the reason)
CAPTURE, REFUND (true / false)    that capture's / refund's SUCCEEDED / DECLINED
CAPTURE_FAILED, REFUND_FAILED     DECLINED for that capture / refund (a scheme rejection)
CANCELLATION, TECHNICAL_CANCEL    true: the voided payment.create DECLINED, code and
                                  lifecycle ``voided``; false: no outcome (evidence only)
anything else                     no outcome (ignored)
================================  ===========================================================

An item names its operation by ``merchantReference``, which payorch sets to the downstream
key (a cancel's reference is the void key, which names the same operation).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ...core import downstream_key as namespace_downstream_key
from ...core import is_namespace_key, operation_id_from_downstream_key
from ...errors import (
    ConfigurationError,
    WebhookMalformed,
    WebhookRejected,
    WebhookSignatureInvalid,
)
from ...provider import TAG_LEGACY_OPERATION_ID, AnswerKind, WebhookBatch, WebhookEvent, WebhookItem

__all__ = [
    "ACKNOWLEDGEMENT",
    "SIGNED_FIELDS",
    "VOIDED",
    "check_merchant_account",
    "decode_hmac_key",
    "item_event",
    "parse_notifications",
    "sign_item",
    "signing_string",
    "verify_item",
]

ACKNOWLEDGEMENT = "[accepted]"
VOIDED = "voided"
SIGNED_FIELDS = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "value",
    "currency",
    "eventCode",
    "success",
)

_SETTLING = frozenset({"AUTHORISATION", "CAPTURE", "REFUND"})
_FAILED = frozenset({"CAPTURE_FAILED", "REFUND_FAILED"})
_CANCELS = frozenset({"CANCELLATION", "TECHNICAL_CANCEL"})
# The operation type each event code reports on: a CAPTURE or REFUND item may carry the
# payment's own reference (a modification made in the Customer Area), and must never settle
# the payment.create found by it.
_OPERATION_OF = {
    "AUTHORISATION": "payment.create",
    "CANCELLATION": "payment.create",
    "TECHNICAL_CANCEL": "payment.create",
    "CAPTURE": "payment.capture",
    "CAPTURE_FAILED": "payment.capture",
    "REFUND": "refund.create",
    "REFUND_FAILED": "refund.create",
}
VOID_REFUSED = "void_refused"  # a cancel that failed: evidence for the void in flight


def decode_hmac_key(key: str) -> bytes:
    """The HMAC key as Adyen's Customer Area shows it (hex) as bytes; ConfigurationError
    for an empty key, an odd length or a character that is not hex."""
    text = key.strip() if isinstance(key, str) else ""
    if not text:
        raise ConfigurationError("the Adyen hmac_key is empty")
    try:
        return binascii.a2b_hex(text)
    except (binascii.Error, ValueError):
        raise ConfigurationError(
            "the Adyen hmac_key is not hex (an even number of 0-9a-f characters)"
        ) from None


def _field(value: object) -> str | None:
    """One signed field as Adyen renders it; None for a value no signature can cover."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int):
        return str(value)
    return None


def signing_string(item: Mapping[str, Any]) -> str | None:
    """The string Adyen signs for ``item``; None when a signed field is not a scalar."""
    amount = item.get("amount")
    amount = amount if isinstance(amount, Mapping) else {}
    values = {**item, "value": amount.get("value"), "currency": amount.get("currency")}
    parts = [_field(values.get(name)) for name in SIGNED_FIELDS]
    if any(part is None for part in parts):
        return None
    return ":".join(part for part in parts if part is not None)


def sign_item(item: Mapping[str, Any], key: bytes) -> str:
    """``item``'s Base64 HMAC-SHA256 signature under ``key`` (raw bytes)."""
    text = signing_string(item)
    if text is None:
        raise ValueError("the item has a signed field that is not a string or a number")
    digest = hmac.new(key, text.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def verify_item(item: Mapping[str, Any], key: bytes) -> None:
    """Raise WebhookSignatureInvalid unless ``item`` carries its valid signature."""
    extra = item.get("additionalData")
    given = extra.get("hmacSignature") if isinstance(extra, Mapping) else None
    if not isinstance(given, str) or not given:
        raise WebhookSignatureInvalid("the notification item carries no hmacSignature")
    text = signing_string(item)
    if text is None:
        raise WebhookSignatureInvalid("the notification item's signed fields are not scalars")
    try:
        signed = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no signature can cover it
        raise WebhookSignatureInvalid(
            "the notification item's signed fields are not Unicode"
        ) from None
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")
    if not given.isascii() or not hmac.compare_digest(expected, given):
        raise WebhookSignatureInvalid("the notification item's hmacSignature does not match")


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _ours(reference: str | None) -> str | None:
    """The downstream key ``reference`` names, when it is one of payorch's.

    A void's reference (``payorch:<ref>:void``) names the operation it voids, whose key has
    the same namespace ref and the ``submit`` step.
    """
    if reference is None:
        return None
    if is_namespace_key(reference):
        ref, step = reference.split(":")[1:]
        return namespace_downstream_key(ref) if step == "void" else reference
    legacy = reference.removesuffix(":void")
    return legacy if operation_id_from_downstream_key(legacy) else None


def _occurred_at(value: object) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise WebhookMalformed("eventDate is not an ISO 8601 string")
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise WebhookMalformed(f"eventDate {value[:40]!r} is not ISO 8601") from None
    return when if when.tzinfo is not None else None


def _success(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise WebhookMalformed("success is neither 'true' nor 'false'")


def item_event(item: Mapping[str, Any]) -> WebhookEvent:
    """A verified notification item as evidence; WebhookMalformed if it lacks Adyen's fields."""
    psp = _text(item.get("pspReference"))
    code = _text(item.get("eventCode"))
    if psp is None or code is None:
        raise WebhookMalformed("the notification item lacks pspReference or eventCode")
    success = _success(item.get("success"))
    reason = _text(item.get("reason"))
    original = _text(item.get("originalReference"))
    merchant_reference = _text(item.get("merchantReference"))
    downstream_key = _ours(merchant_reference)
    outcome: AnswerKind | None = None
    decline: str | None = None
    lifecycle: str | None = None
    reference: str | None = psp
    if code in _SETTLING:
        outcome = AnswerKind.SUCCEEDED if success else AnswerKind.DECLINED
        if not success:
            decline = (reason or f"{code.lower()}_refused")[:64]
    elif code in _FAILED:
        # success says the failure event happened: the capture or refund was rejected.
        outcome, decline = AnswerKind.DECLINED, (reason or code.lower())[:64]
    elif code in _CANCELS:
        # Evidence about the payment that was cancelled: its reference is the original one.
        reference = original
        if success:
            outcome, decline, lifecycle = AnswerKind.DECLINED, VOIDED, VOIDED
        else:
            decline, lifecycle = (reason or "cancel_refused")[:64], VOID_REFUSED
    extra = item.get("additionalData")
    operation_id = operation_id_from_downstream_key(downstream_key) if downstream_key else None
    if operation_id is None and isinstance(extra, Mapping):
        operation_id = _text(extra.get(f"metadata.{TAG_LEGACY_OPERATION_ID}"))
    return WebhookEvent(
        # What identifies a notification to Adyen: a redelivery carries the same three.
        event_id=f"{psp}:{code}:{'true' if success else 'false'}",
        event_type=code,
        outcome=outcome,
        provider_reference=reference,
        downstream_key=downstream_key,
        operation_id=operation_id,
        occurred_at=_occurred_at(item.get("eventDate")),
        body=dict(item),
        code=decline,
        lifecycle=lifecycle,
        operation=_OPERATION_OF.get(code),
    )


def _items(body: bytes) -> list[Mapping[str, Any]]:
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise WebhookMalformed("the notification body is not JSON") from exc
    wrappers = parsed.get("notificationItems") if isinstance(parsed, dict) else None
    if not isinstance(wrappers, list) or not wrappers:
        raise WebhookMalformed("the notification body has no notificationItems")
    items: list[Mapping[str, Any]] = []
    for wrapper in wrappers:
        item = wrapper.get("NotificationRequestItem") if isinstance(wrapper, dict) else None
        if not isinstance(item, dict):
            raise WebhookMalformed("a notification item is not a NotificationRequestItem")
        items.append(item)
    return items


def check_merchant_account(item: Mapping[str, Any], merchant_account: str) -> None:
    """Raise WebhookRejected unless ``item`` is for ``merchant_account``: a webhook set up at
    company level (or pointed at the wrong endpoint) delivers other accounts' items, signed
    with the same key, whose references this adapter never made."""
    code = item.get("merchantAccountCode")
    if code != merchant_account:
        shown = repr(code[:80]) if isinstance(code, str) else "none"
        raise WebhookRejected(
            f"the notification item is for merchant account {shown}, not this adapter's "
            f"{merchant_account!r}"
        )


def parse_notifications(
    body: bytes, key: bytes, merchant_account: str | None = None
) -> WebhookBatch:
    """Every item of an Adyen delivery, each verified on its own (see the module docstring),
    and, given ``merchant_account``, refused unless it is that account's.

    Raises WebhookMalformed for a body that is not Adyen's notification shape.
    """
    out: list[WebhookItem] = []
    for index, item in enumerate(_items(body)):
        try:
            verify_item(item, key)
            if merchant_account is not None:
                check_merchant_account(item, merchant_account)
            out.append(WebhookItem(index=index, event=item_event(item)))
        except WebhookRejected as exc:  # a bad signature, another account, a bad field
            out.append(WebhookItem(index=index, rejected=exc))
    return WebhookBatch(items=tuple(out), acknowledgement=ACKNOWLEDGEMENT)
