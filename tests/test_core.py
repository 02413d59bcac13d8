"""The pure core: transitions, validation, fingerprint properties, keys, backoff."""

from __future__ import annotations

import json
import math
import random
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from payorch.core import (
    MAX_JSON_INT,
    State,
    backoff_delay,
    check_encodable,
    check_transition,
    downstream_key,
    fingerprint,
    operation_id_from_downstream_key,
    validate_idempotency_key,
    validate_operation_name,
    validate_tenant,
)
from payorch.errors import (
    InvalidIdempotencyKey,
    InvalidMoney,
    InvalidRequest,
    InvalidTenant,
    InvalidTransition,
    UnencodableRequest,
    UnknownOperationType,
)

# -- state machine ---------------------------------------------------------------------


@pytest.mark.parametrize("terminal", [State.SUCCEEDED, State.FAILED_FINAL])
@pytest.mark.parametrize("target", list(State))
def test_terminal_states_never_move(terminal: State, target: State) -> None:
    with pytest.raises(InvalidTransition):
        check_transition(terminal, target)


@pytest.mark.parametrize("source", [State.IN_PROGRESS, State.OUTCOME_UNKNOWN])
@pytest.mark.parametrize("target", list(State))
def test_active_states_may_move_anywhere(source: State, target: State) -> None:
    check_transition(source, target)  # does not raise


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["", "a" * 256, "has space", "tab\tkey", "nul\x00", "ünïcode", None, 42]
)
def test_bad_idempotency_keys_are_refused(key: object) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        validate_idempotency_key(key)


@pytest.mark.parametrize("key", ["a", "a" * 255, "order-123:retry_1", "~!@#$%^&*()"])
def test_good_idempotency_keys_pass(key: str) -> None:
    assert validate_idempotency_key(key) == key


@pytest.mark.parametrize("tenant", ["", None, "a b", "x" * 65, "-lead"])
def test_bad_tenants_are_refused(tenant: object) -> None:
    with pytest.raises(InvalidTenant):
        validate_tenant(tenant)


def test_operation_names_must_be_known_when_a_registry_is_given() -> None:
    assert validate_operation_name("payment.create", ["payment.create"]) == "payment.create"
    with pytest.raises(UnknownOperationType):
        validate_operation_name("payment.destroy", ["payment.create"])
    with pytest.raises(UnknownOperationType):
        validate_operation_name("Payment Create")


# -- fingerprint -----------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**53 - 1), 2**53 - 1), st.text(max_size=20)
)
effects = st.dictionaries(st.text(min_size=1, max_size=10), json_scalars, min_size=1, max_size=8)


@given(effects, st.randoms(use_true_random=False))
def test_fingerprint_ignores_key_order(effect: dict[str, object], rnd: random.Random) -> None:
    items = list(effect.items())
    rnd.shuffle(items)
    assert fingerprint(dict(items)) == fingerprint(effect)


@given(effects)
def test_fingerprint_ignores_whitespace_of_the_wire_form(effect: dict[str, object]) -> None:
    spaced = json.loads(json.dumps(effect, indent=4, separators=(" , ", " : ")))
    compact = json.loads(json.dumps(effect, separators=(",", ":")))
    assert fingerprint(spaced) == fingerprint(compact) == fingerprint(effect)


@given(effects, st.data())
def test_fingerprint_changes_when_any_effect_field_changes(
    effect: dict[str, object], data: st.DataObject
) -> None:
    field = data.draw(st.sampled_from(sorted(effect)))
    new_value = data.draw(
        json_scalars.filter(lambda v: v != effect[field] or type(v) is not type(effect[field]))
    )
    if new_value == effect[field] and type(new_value) is type(effect[field]):
        return
    changed = {**effect, field: new_value}
    assert fingerprint(changed) != fingerprint(effect)


def test_fingerprint_of_registered_type_ignores_transport_fields() -> None:
    from payorch.operations import default_registry

    reg = default_registry("sandbox")
    base = {"amount": 1000, "currency": "EUR", "customer": "cus_1"}
    a = reg.prepare(tenant_id="t", operation="payment.create", idempotency_key="k", request=base)
    b = reg.prepare(
        tenant_id="t",
        operation="payment.create",
        idempotency_key="k",
        request={**base, "description": "retry from mobile", "metadata": {"trace": "x"}},
    )
    c = reg.prepare(
        tenant_id="t",
        operation="payment.create",
        idempotency_key="k",
        request={**base, "amount": 1001},
    )
    assert a.new.fingerprint == b.new.fingerprint
    assert a.new.fingerprint != c.new.fingerprint


@pytest.mark.parametrize("bad", [{"amount": 10.5}, {"amount": 10.0}, {"nested": {"x": [1, 2.5]}}])
def test_floats_in_effect_fields_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidMoney):
        fingerprint(bad)


def test_non_json_values_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        fingerprint({"when": object()})


@pytest.mark.parametrize(
    "bad",
    [
        {"s": "\ud800"},
        {"\udc00": "key"},
        {"deep": [{"x": ("ok", "\udfff")}]},
        {"f": math.nan},
        {"f": [math.inf]},
        {"d": Decimal("-Infinity")},
        {"d": Decimal("NaN")},
        {"i": MAX_JSON_INT + 1},
        {"i": -(10**400)},
        {"set": {"\ud800"}},
    ],
)
def test_check_encodable_refuses_what_json_cannot_carry_exactly(bad: dict[str, object]) -> None:
    with pytest.raises(UnencodableRequest) as info:
        check_encodable(bad)
    str(info.value).encode("utf-8")  # the message never carries the bad string itself


def test_check_encodable_refuses_sets_only_where_order_matters() -> None:
    check_encodable({"tags": {"a", "b"}})
    with pytest.raises(UnencodableRequest, match="set"):
        check_encodable({"tags": {"a", "b"}}, sets=False)


@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.text()
        | st.integers(-MAX_JSON_INT, MAX_JSON_INT)
        | st.floats(allow_nan=False, allow_infinity=False),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=20,
    )
)
def test_check_encodable_accepts_what_json_carries(value: object) -> None:
    check_encodable(value)  # st.text() never yields lone surrogates
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")


@given(st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1))
def test_surrogates_in_effect_fields_are_refused_by_the_fingerprint(bad: str) -> None:
    with pytest.raises(UnencodableRequest):
        fingerprint({"customer": bad})
    with pytest.raises(UnencodableRequest):
        fingerprint({bad: 1})


# -- keys and backoff ------------------------------------------------------------------


def test_downstream_key_is_deterministic_and_reversible() -> None:
    op_id = "01930000-0000-7000-8000-000000000001"
    assert downstream_key(op_id) == downstream_key(op_id)
    assert downstream_key(op_id, "capture") != downstream_key(op_id)
    assert operation_id_from_downstream_key(downstream_key(op_id)) == op_id
    assert operation_id_from_downstream_key("someone-else") is None


@given(st.integers(0, 30), st.floats(0, 1, exclude_max=True), st.floats(0, 5))
def test_backoff_stays_within_bounds(attempt: int, r: float, floor: float) -> None:
    delay = backoff_delay(attempt, base=0.1, cap=2.0, rand=lambda: r, floor=floor)
    assert floor <= delay <= max(2.0, floor)
