"""``execute()`` over arbitrary JSON-shaped requests, against the loopback sandbox.

Whatever the caller sends (any unicode including lone surrogates, huge integers, NaN and
infinities, nested objects, unknown keys, wrong types for known fields), every call ends
in an ``Outcome`` or a typed ``PayorchError``, a refusal writes nothing, and no operation
is left ``in_progress`` (the state that the reconciler would re-submit every lease cycle).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from payorch.errors import InvalidRequest, PayorchError
from payorch.executor import Executor
from payorch.outcome import Outcome
from payorch.store import Store
from payorch.tables import operations

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


def _count(store: Store, *where: Any) -> int:
    with store.engine.connect() as conn:
        query = sa.select(sa.func.count()).select_from(operations).where(*where)
        return int(conn.execute(query).scalar_one())


def test_execute_ends_in_an_outcome_or_a_typed_error(executor: Executor, store: Store) -> None:
    keys = itertools.count()
    seen: dict[str, int] = {"outcome": 0, "refused": 0, "other error": 0}

    @settings(
        max_examples=100,
        deadline=None,
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
                seen["refused"] += 1
                assert 400 <= exc.http_status < 500
                if not existed:  # a refusal reserves nothing
                    assert _count(store, operations.c.idempotency_key == key) == 0
            else:
                seen["other error"] += 1
        else:
            assert isinstance(result, Outcome)
            seen["outcome"] += 1
        # Per example (so a failure shrinks to its own request), then for the whole run.
        assert _count(store, operations.c.idempotency_key == key, in_progress) == 0

    in_progress = operations.c.state == "in_progress"
    run()
    assert _count(store, in_progress) == 0
    # The strategy must reach the provider often enough for the property to mean something.
    assert seen["outcome"] >= 10, seen
    assert seen["refused"] >= 10, seen
