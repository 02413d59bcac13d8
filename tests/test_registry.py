"""Bad input is refused before anything is written."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from payorch.errors import (
    InvalidIdempotencyKey,
    InvalidRequest,
    InvalidTenant,
    RequestValidationFailed,
    UnencodableRequest,
    UnknownOperationType,
)
from payorch.execution._executor import Executor
from payorch.operations import REDACTED, OperationType, default_registry
from payorch.providers.sandbox import SandboxServer
from payorch.storage._store import Store
from payorch.storage._tables import operations

GOOD = {"amount": 1000, "currency": "EUR", "customer": "cus_1"}


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"tenant_id": ""}, InvalidTenant),
        ({"idempotency_key": ""}, InvalidIdempotencyKey),
        ({"idempotency_key": "k" * 256}, InvalidIdempotencyKey),
        ({"idempotency_key": "bell\x07"}, InvalidIdempotencyKey),
        ({"operation": "payment.teleport"}, UnknownOperationType),
        ({"request": {**GOOD, "amount": 10.5}}, RequestValidationFailed),
        ({"request": {**GOOD, "amount": 10.0}}, RequestValidationFailed),
        ({"request": {**GOOD, "amount": "1000"}}, RequestValidationFailed),
        ({"request": {**GOOD, "currency": "XXY"}}, RequestValidationFailed),
        ({"request": {**GOOD, "surprise": 1}}, RequestValidationFailed),
    ],
)
def test_bad_input_is_a_typed_error_and_writes_nothing(
    store: Store, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    reg = default_registry("sandbox")
    args: dict[str, Any] = {
        "tenant_id": "t1",
        "operation": "payment.create",
        "idempotency_key": "k1",
        "request": GOOD,
        **kwargs,
    }
    with pytest.raises(error) as info:
        reg.prepare(**args)
    assert isinstance(info.value, InvalidRequest)
    assert info.value.http_status in (400, 422)
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar() == 0


def test_sensitive_fields_are_redacted_before_storage() -> None:
    from pydantic import BaseModel

    class CardPayment(BaseModel):
        amount: int
        currency: str
        card_number: str

    reg = default_registry("sandbox")
    reg.register(
        OperationType(
            name="card.charge",
            model=CardPayment,
            effect_fields=("amount", "currency"),
            sensitive_fields=("card_number",),
            provider="sandbox",
        )
    )
    prepared = reg.prepare(
        tenant_id="t",
        operation="card.charge",
        idempotency_key="k",
        request={"amount": 5, "currency": "EUR", "card_number": "4242424242424242"},
    )
    assert prepared.new.request is not None
    assert prepared.new.request["card_number"] == REDACTED
    assert prepared.payload["card_number"] == "4242424242424242"


# -- requests no encoder can carry: refused before the claim (issue 8, item 5) -------------

SURROGATE = "\ud800"


@pytest.mark.parametrize(
    ("operation", "request_"),
    [
        ("payment.create", {**GOOD, "description": f"order {SURROGATE}"}),
        ("payment.create", {**GOOD, "metadata": {"note": SURROGATE}}),
        ("payment.create", {**GOOD, "metadata": {SURROGATE: "x"}}),
        ("payment.create", {**GOOD, "customer": "cus_\udfff"}),  # an effect field
        ("payment.create", {**GOOD, "description": "\ud83d\ude00"}),  # a pair, as two code points
        (
            "payout.create",
            {"amount": 5, "currency": "EUR", "destination": "ba_1", "description": SURROGATE},
        ),
        ("refund.create", {"payment_intent": f"pi_{SURROGATE}"}),
    ],
)
def test_unencodable_strings_are_refused_before_the_claim(
    executor: Executor,
    store: Store,
    sandbox: SandboxServer,
    operation: str,
    request_: dict[str, Any],
) -> None:
    with pytest.raises(UnencodableRequest) as info:
        executor.execute(
            tenant_id="t1", operation=operation, idempotency_key="k-sur", request=request_
        )
    assert info.value.http_status == 400
    str(info.value).encode("utf-8")  # the error itself can be reported
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar() == 0
    assert sandbox.ledger() == []
    # The same key with the request fixed is a first attempt, not a conflict.
    fixed = executor.execute(
        tenant_id="t1",
        operation="payment.create",
        idempotency_key="k-sur",
        request={**GOOD, "description": "order \U0001f600", "metadata": {"note": "\x00ok"}},
    )
    assert not fixed.replayed
    assert fixed.state.value == "succeeded"
    assert len(sandbox.ledger()) == 1


def test_validation_errors_naming_a_bad_key_can_be_reported() -> None:
    reg = default_registry("sandbox")
    with pytest.raises(RequestValidationFailed) as info:
        reg.prepare(
            tenant_id="t",
            operation="payment.create",
            idempotency_key="k",
            request={**GOOD, "metadata": {SURROGATE: 5}},
        )
    str(info.value).encode("utf-8")
    json.dumps(info.value.errors, ensure_ascii=False).encode("utf-8")
