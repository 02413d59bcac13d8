"""``execute()`` over arbitrary JSON-shaped requests, against the loopback sandbox.

Whatever the caller sends (any unicode including lone surrogates, huge integers, NaN and
infinities, nested objects, unknown keys, wrong types for known fields), every call ends
in an ``Outcome`` or a typed ``PayorchError``, a refusal writes nothing, and no operation
is left ``in_progress`` (the state that the reconciler would re-submit every lease cycle).

The property means something only if it is checked on requests that reach the provider and
on requests that are refused. That is not left to what the strategy happens to draw: fixed
lists of both kinds are explicit examples of the property, and a test of their own pins
that the first reach the provider and the second are refused.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from payorch.errors import InvalidRequest, PayorchError
from payorch.execution._executor import Executor
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxServer
from payorch.storage._store import Store
from payorch.storage._tables import operations

TENANT = "fuzz"

# Surrogates, NUL, controls, non-BMP and plain text, drawn often enough to matter.
_ODD = ["\ud800", "\udbff", "\udc00", "\udfff", "\x00", "\x1f", "\u2028", "\ufffe", "😀", "é"]
# (st.text() drops surrogates whatever its alphabet says: join the characters ourselves.)
texts = st.lists(st.sampled_from(_ODD) | st.characters(codec=None), max_size=12).map("".join)
numbers = (
    st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 2**53, 2**53 + 1])
)
scalars = st.none() | st.booleans() | numbers | texts
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)

# Per operation type: a strategy for a plausible value of each known field. A drawn request
# keeps, drops or replaces each one with an arbitrary JSON value, then adds unknown keys.
_GOOD: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "payment.create": {
        "amount": st.integers(1, 10**6),
        "currency": st.sampled_from(["EUR", "USD", "JPY", "GBP", "eur"]),
        "customer": st.just("cus_1") | texts,
        "payment_method": st.sampled_from(["pm_card_visa", "pm_card_declined"]) | texts,
        "capture_method": st.sampled_from(["automatic", "manual"]),
        "description": texts,
        "metadata": st.dictionaries(texts, texts, max_size=3),
    },
    "payment.capture": {
        "payment_intent": st.just("pi_missing") | texts,
        "amount_to_capture": st.integers(0, 10**6),
    },
    "refund.create": {
        "payment_intent": st.just("pi_missing") | texts,
        "amount": st.integers(1, 10**6),
        "currency": st.sampled_from(["EUR", "USD"]),
        "reason": texts,
    },
    "payout.create": {
        "amount": st.integers(1, 10**6),
        "currency": st.sampled_from(["EUR", "GBP"]),
        "destination": st.just("ba_1") | texts,
        "description": texts,
    },
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, Any]:
    operation = draw(st.sampled_from(sorted(_GOOD)))
    if draw(st.integers(0, 19)) == 0:
        return operation, draw(json_values)  # not even an object
    request: dict[str, Any] = {}
    for name, good in _GOOD[operation].items():
        how = draw(st.sampled_from(["good"] * 8 + ["drop", "random"]))
        if how == "good":
            request[name] = draw(good)
        elif how == "random":
            request[name] = draw(json_values)
    if draw(st.integers(0, 4)) == 0:
        request.update(draw(st.dictionaries(texts, json_values, max_size=2)))
    return operation, request


# Requests that pass every check and reach the provider: each ends in an Outcome (a decline
# included) and adds one entry to the sandbox's ledger.
REACHES_THE_PROVIDER: list[tuple[str, Any]] = [
    ("payment.create", {"amount": 1250, "currency": "EUR", "customer": "cus_1"}),
    (
        "payment.create",
        {"amount": 1, "currency": "JPY", "customer": "cus_1", "payment_method": "pm_card_declined"},
    ),
    (
        "payment.create",
        {
            "amount": 10**6,
            "currency": "USD",
            "customer": "cus_1",
            "payment_method": "pm_card_visa",
            "capture_method": "manual",
            "description": "😀 é \u2028",
            "metadata": {"é": "😀"},
        },
    ),
    ("payment.create", {"amount": 7, "currency": "eur", "customer": "😀"}),
    ("payment.capture", {"payment_intent": "pi_missing", "amount_to_capture": 0}),
    ("refund.create", {"payment_intent": "pi_missing", "amount": 1, "currency": "USD"}),
    ("payout.create", {"amount": 500, "currency": "GBP", "destination": "ba_1"}),
    (
        "payout.create",
        {"amount": 10**6, "currency": "EUR", "destination": "ba_1", "description": ""},
    ),
]
# Requests refused before anything is stored or sent: an InvalidRequest (4xx).
PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_1"}
REFUSED: list[tuple[str, Any]] = [
    ("payment.create", [1, 2]),  # not an object
    ("payment.create", None),
    ("payment.create", "\ud800"),
    ("payment.create", {**PAYMENT, "amount": math.nan}),
    ("payment.create", {**PAYMENT, "amount": -math.inf}),
    ("payment.create", {**PAYMENT, "amount": 2**70}),
    ("payment.create", {**PAYMENT, "amount": "1250"}),
    ("payment.create", {**PAYMENT, "amount": True}),
    ("payment.create", {**PAYMENT, "customer": "\ud800"}),  # a lone surrogate
    ("payment.create", {**PAYMENT, "description": "a\udfff"}),
    ("payment.create", {**PAYMENT, "\udc00": 1}),  # an unknown key that is not even UTF-8
    ("payment.create", {**PAYMENT, "metadata": [1]}),
    ("payment.create", {**PAYMENT, "unknown": 1}),
    ("payment.capture", {"payment_intent": {"id": "pi_1"}}),
    ("refund.create", {"payment_intent": "pi_missing", "amount": 2**53 + 1, "currency": "USD"}),
    ("payout.create", {"amount": 500, "currency": "EUR", "destination": None}),
]


def _count(store: Store, *where: Any) -> int:
    with store.engine.connect() as conn:
        query = sa.select(sa.func.count()).select_from(operations).where(*where)
        return int(conn.execute(query).scalar_one())


def test_execute_ends_in_an_outcome_or_a_typed_error(executor: Executor, store: Store) -> None:
    keys = itertools.count()

    @settings(
        max_examples=100,
        deadline=None,  # each example is a round trip to the database and the sandbox
        database=None,  # the store and the sandbox live for this test only
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(drawn=requests(), reuse=st.integers(0, 4))
    def run(drawn: tuple[str, Any], reuse: int) -> None:
        operation, request = drawn
        n = next(keys)
        # Sometimes the previous key again: a replay, a conflict or a retry after a refusal.
        key = f"fz-{n - 1 if reuse == 0 and n else n}"
        existed = _count(store, operations.c.idempotency_key == key) > 0
        try:
            result = executor.execute(
                tenant_id=TENANT, operation=operation, idempotency_key=key, request=request
            )
        except PayorchError as exc:
            str(exc).encode("utf-8")  # the error can be reported as it stands
            if isinstance(exc, InvalidRequest):
                assert 400 <= exc.http_status < 500
                if not existed:  # a refusal reserves nothing
                    assert _count(store, operations.c.idempotency_key == key) == 0
        else:
            assert isinstance(result, Outcome)
        # Per example (so a failure shrinks to its own request), then for the whole run.
        assert _count(store, operations.c.idempotency_key == key, in_progress) == 0

    # Whatever is drawn, the property is checked on both kinds: these run first, each once.
    for case in REACHES_THE_PROVIDER + REFUSED:
        run = example(drawn=case, reuse=1)(run)
    in_progress = operations.c.state == "in_progress"
    run()
    assert _count(store, in_progress) == 0


def test_the_fixed_requests_reach_the_provider(
    executor: Executor, store: Store, sandbox: SandboxServer
) -> None:
    for n, (operation, request) in enumerate(REACHES_THE_PROVIDER):
        outcome = executor.execute(
            tenant_id=TENANT, operation=operation, idempotency_key=f"fixed-{n}", request=request
        )
        assert isinstance(outcome, Outcome)
        assert len(sandbox.ledger()) == n + 1, (operation, request)  # it reached the provider
    assert _count(store, operations.c.state == "in_progress") == 0


def test_the_fixed_bad_requests_are_refused_and_reserve_nothing(
    executor: Executor, store: Store, sandbox: SandboxServer
) -> None:
    for n, (operation, request) in enumerate(REFUSED):
        try:
            executor.execute(
                tenant_id=TENANT, operation=operation, idempotency_key=f"fixed-{n}", request=request
            )
        except InvalidRequest as refused:
            assert 400 <= refused.http_status < 500
            str(refused).encode("utf-8")  # reportable as it stands
        else:
            pytest.fail(f"not refused: {operation} {request!r}")
    assert _count(store) == 0
    assert sandbox.ledger() == []
