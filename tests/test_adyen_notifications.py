"""Adyen notifications: every item's HMAC verified (the official library's test vectors, and
the official package as an oracle), batches with a tampered item, and the evidence items give."""

from __future__ import annotations

import copy
import importlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from payorch.core import downstream_key, namespace_ref
from payorch.errors import ConfigurationError, WebhookMalformed, WebhookSignatureInvalid
from payorch.provider import AnswerKind, parse_deliveries
from payorch.providers.adyen import ACKNOWLEDGEMENT, AdyenProvider, sign_item, signing_string

KEY_A = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
KEY_B = "74F490DD33F7327BAECC88B2947C011FC02D014A473AAA33A8EC93E4DC069174"
PAY_KEY = downstream_key(namespace_ref("tenant-a", "payment.create", "order-17"))

# The official Python library's vectors (test/UtilTest.py, test/mocks/util/*.json).
VECTOR_A = {
    "pspReference": "7914073381342284",
    "merchantReference": "TestPayment-1407325143704",
    "merchantAccountCode": "TestMerchant",
    "amount": {"currency": "EUR", "value": 1130},
    "eventCode": "AUTHORISATION",
    "success": "true",
    "eventDate": "2019-05-06T17:15:34.121+02:00",
    "operations": ["CANCEL", "CAPTURE", "REFUND"],
    "paymentMethod": "visa",
    "additionalData": {"hmacSignature": "coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0="},
}
SLASHES = [  # pspReference, merchantReference, hmacSignature; all under KEY_B
    ("T7FD4VM4D3RZNN82", "\\\\slashes are fun", "nIgT81gaB5oJpn2jPXupDq68iRo2wUlBsuYjtYfwKqo="),
    ("M8NB66SBZSGLNK82", ":slashes are fun", "2EQYm7YJpKO4EtHSPu55SQTyWf8dkW5u2nD1tJFpViA="),
    ("X3GWNS6KJ8NKGK82", "//slashes are fun", "9Z0xdpG9Xi3zcmXv14t/BvMBut77O/Xq9D4CQXSDUi4="),
    ("ZVWN7D3WSMK2WN82", "\\:/\\/slashes are fun", "CZErGCNQaSsxbaQfZaJlakqo7KPP+mIa8a+wx3yNs9A="),
]


def slashed(psp: str, reference: str, signature: str) -> dict[str, Any]:
    return {
        "additionalData": {"hmacSignature": signature},
        "amount": {"currency": "EUR", "value": 1000},
        "eventCode": "AUTHORISATION",
        "eventDate": "2023-01-10T13:40:54+01:00",
        "merchantAccountCode": "AntoniStroinski",
        "merchantReference": reference,
        "pspReference": psp,
        "success": "true",
    }


def provider(key: str = KEY_A, merchant_account: str = "TestMerchant") -> AdyenProvider:
    return AdyenProvider(
        api_key="k", merchant_account=merchant_account, hmac_key=key, base_url="http://127.0.0.1:9"
    )


def body(*items: dict[str, Any]) -> bytes:
    wrapped = [{"NotificationRequestItem": i} for i in items]
    return json.dumps({"live": "false", "notificationItems": wrapped}).encode()


def signed(key: str = KEY_A, **fields: Any) -> dict[str, Any]:
    item: dict[str, Any] = {
        "amount": {"currency": "EUR", "value": 1000},
        "eventCode": "AUTHORISATION",
        "eventDate": "2026-01-10T13:40:54+01:00",
        "merchantAccountCode": "TestMerchant",
        "merchantReference": PAY_KEY,
        "pspReference": "993617895204576J",
        "success": "true",
        "reason": "",
    }
    item.update(fields)
    item["additionalData"] = {"hmacSignature": sign_item(item, bytes.fromhex(key))}
    return item


def test_vector_a_verifies() -> None:
    assert signing_string(VECTOR_A) == (
        "7914073381342284::TestMerchant:TestPayment-1407325143704:1130:EUR:AUTHORISATION:true"
    )
    event = provider().parse_webhook({}, body(VECTOR_A))
    assert (event.event_type, event.outcome) == ("AUTHORISATION", AnswerKind.SUCCEEDED)
    assert event.downstream_key is None  # not one of payorch's references


@pytest.mark.parametrize(("psp", "reference", "signature"), SLASHES)
def test_slashes_and_colons_are_signed_unescaped(psp: str, reference: str, signature: str) -> None:
    item = slashed(psp, reference, signature)
    assert sign_item(item, bytes.fromhex(KEY_B)) == signature
    batch = provider(KEY_B, "AntoniStroinski").parse_webhooks({}, body(item))
    assert batch.items[0].event is not None


def test_every_item_is_verified_not_only_the_first() -> None:
    first, second, third = signed(), signed(pspReference="A2"), signed(pspReference="A3")
    second["amount"]["value"] = 1  # changed after signing
    del third["additionalData"]
    batch = provider().parse_webhooks({}, body(first, second, third))
    assert batch.acknowledgement == ACKNOWLEDGEMENT == "[accepted]"
    assert [i.index for i in batch.items] == [0, 1, 2]
    assert batch.items[0].event is not None and batch.items[0].rejected is None
    assert isinstance(batch.items[1].rejected, WebhookSignatureInvalid)
    assert isinstance(batch.items[2].rejected, WebhookSignatureInvalid)
    assert parse_deliveries(provider(), {}, body(first, second)).items[1].event is None


def test_the_single_form_raises_the_first_items_rejection() -> None:
    item = signed()
    item["success"] = "false"
    with pytest.raises(WebhookSignatureInvalid):
        provider().parse_webhook({}, body(item, signed()))
    with pytest.raises(WebhookSignatureInvalid):
        provider(KEY_B).parse_webhook({}, body(signed()))  # another key


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"live": "false"}',
        b'{"notificationItems": []}',
        b'{"notificationItems": [1]}',
    ],
)
def test_a_body_of_another_shape_is_malformed(raw: bytes) -> None:
    with pytest.raises(WebhookMalformed):
        provider().parse_webhooks({}, raw)


def test_a_non_hex_key_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="not hex"):
        provider("not-hex!")
    with pytest.raises(ConfigurationError):
        provider("abc")  # odd length
    with pytest.raises(ConfigurationError, match="hmac_key"):
        AdyenProvider(api_key="k", merchant_account="m", base_url="http://x").parse_webhooks(
            {}, b""
        )


@pytest.mark.parametrize(
    ("fields", "outcome", "code", "lifecycle"),
    [
        ({}, AnswerKind.SUCCEEDED, None, None),
        ({"success": "false", "reason": "Refused"}, AnswerKind.DECLINED, "Refused", None),
        ({"eventCode": "CAPTURE", "originalReference": "P1"}, AnswerKind.SUCCEEDED, None, None),
        (
            {"eventCode": "CAPTURE", "success": "false"},
            AnswerKind.DECLINED,
            "capture_refused",
            None,
        ),
        (
            {"eventCode": "CAPTURE_FAILED", "reason": "Capture Failed"},
            AnswerKind.DECLINED,
            "Capture Failed",
            None,
        ),
        ({"eventCode": "REFUND"}, AnswerKind.SUCCEEDED, None, None),
        ({"eventCode": "REFUND_FAILED"}, AnswerKind.DECLINED, "refund_failed", None),
        (
            {"eventCode": "CANCELLATION", "originalReference": "P1"},
            AnswerKind.DECLINED,
            "voided",
            "voided",
        ),
        ({"eventCode": "TECHNICAL_CANCEL"}, AnswerKind.DECLINED, "voided", "voided"),
        (
            {"eventCode": "TECHNICAL_CANCEL", "success": "false", "reason": "captured"},
            None,
            "captured",
            "void_refused",
        ),
        ({"eventCode": "REPORT_AVAILABLE"}, None, None, None),
    ],
)
def test_what_each_event_code_is_evidence_of(
    fields: dict[str, Any], outcome: AnswerKind | None, code: str | None, lifecycle: str | None
) -> None:
    event = provider().parse_webhook({}, body(signed(**fields)))
    assert (event.outcome, event.code, event.lifecycle) == (outcome, code, lifecycle)
    assert event.downstream_key == PAY_KEY
    reports_on = {"CAPTURE": "payment.capture", "REFUND": "refund.create"}
    event_code = fields.get("eventCode", "AUTHORISATION")
    expected = next(
        (op for prefix, op in reports_on.items() if event_code.startswith(prefix)),
        None if event_code == "REPORT_AVAILABLE" else "payment.create",
    )
    assert event.operation == expected
    assert event.occurred_at is not None and event.occurred_at.utcoffset() is not None
    if fields.get("eventCode") in ("CANCELLATION", "TECHNICAL_CANCEL"):
        assert event.provider_reference == fields.get("originalReference")
    else:
        assert event.provider_reference == "993617895204576J"


def test_a_cancel_under_the_void_key_names_the_voided_payment() -> None:
    void_key = PAY_KEY.rsplit(":", 1)[0] + ":void"
    event = provider().parse_webhook(
        {}, body(signed(eventCode="CANCELLATION", merchantReference=void_key))
    )
    assert event.downstream_key == PAY_KEY


def test_a_redelivery_has_the_same_event_id() -> None:
    item = signed()
    again = copy.deepcopy(item)
    again["eventDate"] = "2026-01-11T00:00:00+01:00"  # not signed: a later redelivery
    ids = {provider().parse_webhook({}, body(i)).event_id for i in (item, again)}
    assert ids == {"993617895204576J:AUTHORISATION:true"}


def test_an_item_with_a_bad_date_is_rejected_alone() -> None:
    batch = provider().parse_webhooks({}, body(signed(), signed(eventDate="yesterday")))
    assert batch.items[0].event is not None
    assert isinstance(batch.items[1].rejected, WebhookMalformed)


_texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
_items = st.fixed_dictionaries(
    {
        "pspReference": st.text("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789", min_size=16, max_size=16),
        "merchantReference": _texts,
        "merchantAccountCode": _texts,
        "amount": st.fixed_dictionaries(
            {"value": st.integers(0, 10**12), "currency": st.sampled_from(["EUR", "USD", "JPY"])}
        ),
        "eventCode": st.sampled_from(["AUTHORISATION", "CAPTURE", "REFUND", "CANCELLATION"]),
        "success": st.sampled_from(["true", "false"]),
    },
    optional={"originalReference": _texts},
)


@settings(max_examples=50)
@given(item=_items, key=st.binary(min_size=32, max_size=32))
def test_signatures_agree_with_the_official_package(item: dict[str, Any], key: bytes) -> None:
    try:
        util = importlib.import_module("Adyen.util")
    except ImportError:
        pytest.skip("the official adyen package is not installed (a test-only oracle)")
    hex_key = key.hex()
    ours = sign_item(item, key)
    assert util.generate_notification_sig(item, hex_key).decode() == ours
    with_signature = {**item, "additionalData": {"hmacSignature": ours}}
    assert util.is_valid_hmac_notification(with_signature, hex_key)
    if item["merchantAccountCode"].strip():  # an adapter's merchant account is never blank
        adapter = provider(hex_key, item["merchantAccountCode"])
        assert adapter.parse_webhooks({}, body(with_signature)).items[0].event is not None
