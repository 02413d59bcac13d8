"""``payorch.core.canonical_json`` writes RFC 8785 bytes: the standard library's encoder for
plain values, ``rfc8785`` for the rest. Every fingerprint and every stored downstream answer
depends on those bytes never changing, so the fast path is held byte-equal to ``rfc8785``
over generated values, and the values it must not take are shown to go to ``rfc8785``."""

from __future__ import annotations

from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from payorch.core import MAX_JSON_INT, canonical_digest, canonical_json
from payorch.core import _jcs_plain as plain
from payorch.errors import UnencodableRequest

# Text without lone surrogates (no encoder can send those): controls, quotes, backslashes,
# U+2028, DEL, astral characters, everything else.
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-MAX_JSON_INT, max_value=MAX_JSON_INT)
    | texts
    | st.sampled_from(["", '"', "\\", "\x00\x1f\x7f", "\u2028\u2029", "\U0001f600", "é"])
)
ascii_keys = st.text(st.characters(max_codepoint=127), max_size=6)
plain_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ascii_keys, inner, max_size=4),
    max_leaves=20,
)
# Keys beyond ASCII: U+E000-U+FFFF sort after astral characters in UTF-16 order only.
any_keys = st.text(st.characters(exclude_categories=("Cs",)), max_size=4) | st.sampled_from(
    ["\ue000", "\U00010000", "\uffff", "a"]
)
json_values = st.recursive(
    scalars | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_keys, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(plain_values)
def test_plain_values_take_the_fast_path_and_match_rfc8785(value: Any) -> None:
    assert plain(value)
    assert canonical_json(value) == rfc8785.dumps(value)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_every_json_value_matches_rfc8785(value: Any) -> None:
    assert canonical_json(value) == rfc8785.dumps(value)


@pytest.mark.parametrize(
    "value",
    [
        {"\U00010000": 1, "\ue000": 2},  # UTF-16 order differs from code point order
        {"amount": 1.5},
        2**53,
        [1, (2, 3)],
        {1: "a"},
    ],
    ids=["astral-key", "float", "beyond-safe-int", "tuple", "int-key"],
)
def test_what_the_fast_path_leaves_to_rfc8785(value: Any) -> None:
    assert not plain(value)
    try:
        expected = rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, TypeError, ValueError):
        with pytest.raises((rfc8785.CanonicalizationError, TypeError, ValueError)):
            canonical_json(value)
        return
    assert canonical_json(value) == expected


def test_a_lone_surrogate_is_refused_as_before() -> None:
    with pytest.raises(UnencodableRequest, match="cannot be canonicalised"):
        canonical_digest({"customer": "cus_\ud800"}, "effect fields")


def test_a_known_fingerprint_is_unchanged() -> None:
    # Stored fingerprints never change: the digest of a payment's effect, pinned.
    effect = {
        "amount": 1999,
        "currency": "EUR",
        "customer": "cus_42",
        "payment_method": "pm_card_visa",
        "capture_method": None,
    }
    pinned = "5e51bce0f8b405d14a24a2ccdf1b061e437cdf2409905cc41c935eb4ce4f98bf"
    assert canonical_digest(effect) == pinned
