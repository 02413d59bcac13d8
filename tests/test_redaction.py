"""Redaction that holds (issue 11, item 3): a sensitive value is stored nowhere, neither in
the fingerprint nor where the provider echoes it (response, event details, webhook inbox).
The proof is a dump of the whole database searched for the raw values."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
from datetime import timedelta

import pytest
import sqlalchemy as sa
from conftest import make_due
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from payorch import WebhookHandler, WebhookStatus
from payorch.core import State
from payorch.errors import ConfigurationError
from payorch.execution._executor import Executor
from payorch.operations import REDACTED, OperationType, Registry, default_registry
from payorch.provider import Answer, AnswerKind
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.records import Redactor
from payorch.storage._store import Store

CARD = "4000056655665556"
HOLDER = "Jane Q. Secretperson"
SECRETS = (CARD, HOLDER)


class CardCharge(BaseModel):
    amount: int
    currency: str
    card_number: str
    holder: str
    description: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


CARD_CHARGE = OperationType(
    name="card.charge",
    model=CardCharge,
    effect_fields=("amount", "currency"),
    sensitive_fields=("card_number", "holder"),
    provider="sandbox",
)


class ExpiringCharge(BaseModel):
    amount: int
    currency: str
    card_number: str
    exp_month: int
    cvc: str | None = None
    description: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


EXPIRY_CHARGE = OperationType(
    name="card.expiring",
    model=ExpiringCharge,
    effect_fields=("amount", "currency"),
    sensitive_fields=("card_number", "exp_month", "cvc"),
    provider="sandbox",
)


def expiring_charge(order: str) -> dict[str, object]:
    """An amount of 12 with an expiry month of 12, and 12s the app put elsewhere."""
    return {
        "amount": 12,
        "currency": "EUR",
        "card_number": CARD,
        "exp_month": 12,
        "description": f"12 x 12 cm for {CARD}",
        "metadata": {"quantity": "12", "card": CARD, "card_exp_month": "12", "order": order},
    }


def charge(order: str) -> dict[str, object]:
    # The app copies the card into metadata and a description: the sandbox echoes metadata
    # in its answer, its status query and its webhooks.
    return {
        "amount": 500,
        "currency": "EUR",
        "card_number": CARD,
        "holder": HOLDER,
        "description": f"card {CARD} of {HOLDER}",
        "metadata": {"card": CARD, "cardholder": HOLDER, "order": order},
    }


# -- refusal of a recoverable fingerprint ------------------------------------------------------


def test_a_sensitive_effect_field_is_refused_at_registration() -> None:
    with pytest.raises(ConfigurationError, match="both sensitive and effect"):
        OperationType(
            name="card.charge",
            model=CardCharge,
            effect_fields=("amount", "currency", "card_number"),
            sensitive_fields=("card_number",),
        )
    registry = Registry()
    registry.register(CARD_CHARGE)  # disjoint fields: fine
    assert list(registry.names()) == ["card.charge"]


def test_a_copied_sensitive_value_is_redacted_in_the_stored_request() -> None:
    registry = default_registry("sandbox")
    registry.register(CARD_CHARGE)
    prepared = registry.prepare(
        tenant_id="shop", operation="card.charge", idempotency_key="k", request=charge("o-1")
    )
    stored = prepared.new.request
    assert stored == {
        "amount": 500,
        "currency": "EUR",
        "card_number": REDACTED,
        "holder": REDACTED,
        "description": f"card {REDACTED} of {REDACTED}",
        "metadata": {"card": REDACTED, "cardholder": REDACTED, "order": "o-1"},
    }
    assert prepared.payload["card_number"] == CARD  # what the provider gets is whole


# -- the one redaction function -----------------------------------------------------------------


def test_redactor_with_the_request_in_hand_finds_values_anywhere() -> None:
    stored = {"card_number": REDACTED, "account": REDACTED, "note": "x"}
    redactor = Redactor.of(stored, {"card_number": CARD, "account": 908172640031, "note": "x"})
    body = {
        "id": "pi_1",
        "metadata": {"copy": CARD, CARD: "as a key", "n": 908172640031, "s": "908172640031"},
        "lines": [{"text": f"charged {CARD}."}],
        "amount": 500,
    }
    out = redactor.json(body)
    assert out == {
        "id": "pi_1",
        # A number of eight digits or more is as telling as its text: hidden anywhere.
        "metadata": {"copy": REDACTED, REDACTED: "as a key", "n": REDACTED, "s": REDACTED},
        "lines": [{"text": f"charged {REDACTED}."}],
        "amount": 500,
    }
    answer = Answer(
        kind=AnswerKind.AMBIGUOUS,
        message=f"card {CARD} refused",
        raw=f'{{"card": "{CARD[:9]}',  # cut mid-value by the evidence limit
        code="c",
    )
    cleaned = redactor.answer(answer)
    assert CARD not in (cleaned.message or "") and CARD[:9] not in (cleaned.raw or "")
    assert cleaned.kind is AnswerKind.AMBIGUOUS and cleaned.code == "c"


def test_redactor_from_the_stored_request_alone_goes_by_name() -> None:
    stored = {"card_number": REDACTED, "metadata": {"card": REDACTED, "order": "o-1"}}
    redactor = Redactor.of(stored)
    body = {"data": {"metadata": {"card": CARD, "order": "o-1"}, "card_number": CARD}}
    assert redactor.json(body) == {
        "data": {"metadata": {"card": REDACTED, "order": "o-1"}, "card_number": REDACTED}
    }
    assert not Redactor.of({"amount": 5})  # nothing sensitive: bodies stored as they are


# -- matching by value, not by bare small numbers (issue 25, item 8b) ---------------------------

EXPIRING = Redactor.for_request(("exp_month", "cvc"), [12, "737"])


def test_a_small_sensitive_number_is_redacted_only_under_its_name() -> None:
    body = {
        "amount": 12,
        "quantity": "12",
        "ratio": 12.0,
        "flags": [True, 12, "12"],
        "description": "12 items, 737 g",
        "exp_month": 12,
        "card": {"exp_month": 12, "expMonth": "12", "card_exp_month": 12, "cvc": "737"},
        "metadata": {"cvc_check": "737", "code": "737", "exp_month_hint": [12, 1]},
    }
    assert EXPIRING.json(body) == {
        "amount": 12,
        "quantity": "12",
        "ratio": 12.0,
        "flags": [True, 12, "12"],
        "description": "12 items, 737 g",
        "exp_month": REDACTED,
        "card": {
            "exp_month": REDACTED,
            "expMonth": REDACTED,
            "card_exp_month": REDACTED,
            "cvc": REDACTED,
        },
        # A key holding a sensitive name's words (in order) says the value is that field;
        # a digit-only CVC, like a short number, goes only there ("code" names no field).
        "metadata": {"cvc_check": REDACTED, "code": "737", "exp_month_hint": [REDACTED, 1]},
    }
    answer = Answer(kind=AnswerKind.DECLINED, message="month 12 refused", code="12")
    assert EXPIRING.answer(answer) == answer  # no name in plain text: nothing to match


def test_a_long_sensitive_value_is_redacted_wherever_it_appears() -> None:
    redactor = Redactor.for_request(("card_number", "exp_month"), [CARD, 12])
    body = {
        "id": "pi_1",
        "amount": 12,
        "echo": CARD,
        CARD: "a key",
        "error": {"message": f"card {CARD} has expired"},
        "lines": [{"note": CARD}, 12],
    }
    assert redactor.json(body) == {
        "id": "pi_1",
        "amount": 12,
        "echo": REDACTED,
        REDACTED: "a key",
        "error": {"message": f"card {REDACTED} has expired"},
        "lines": [{"note": REDACTED}, 12],
    }
    cut = Answer(kind=AnswerKind.AMBIGUOUS, raw=f'{{"amount": 12, "card": "{CARD[:7]}')
    assert redactor.answer(cut).raw == f'{{"amount": 12, "card": "{REDACTED}'


def test_the_stored_request_keeps_every_other_12() -> None:
    registry = Registry()
    registry.register(EXPIRY_CHARGE)
    prepared = registry.prepare(
        tenant_id="shop",
        operation="card.expiring",
        idempotency_key="k",
        request=expiring_charge("o-12"),
    )
    assert prepared.new.request == {
        "amount": 12,
        "currency": "EUR",
        "card_number": REDACTED,
        "exp_month": REDACTED,
        "cvc": None,  # a sensitive field left empty hides nothing, and stays resendable
        "description": f"12 x 12 cm for {REDACTED}",
        "metadata": {
            "quantity": "12",
            "card": REDACTED,
            "card_exp_month": REDACTED,
            "order": "o-12",
        },
    }
    assert prepared.payload["exp_month"] == 12 and prepared.payload["metadata"]["card"] == CARD


PAN = 4242424242424242  # a card number sent as a JSON number


def test_a_card_number_sent_as_a_number_is_hidden_anywhere() -> None:
    """Eight digits or more: the number itself, wherever a whole number equals it, and its
    text as a whole string and inside longer text; never a boolean or a small number."""
    redactor = Redactor.for_request(("card_number", "exp_month"), [PAN, 12])
    body = {
        "card": {"number": PAN, "last4": "4242"},
        "pan": PAN,
        "as_float": float(PAN),
        "metadata": {"ref": PAN, "ref_text": str(PAN), "quantity": "12", "size": 12},
        "message": f"card {PAN} refused",
        "amount": 12,
        "captured": True,
    }
    assert redactor.json(body) == {
        # "4242" is no sensitive value: the card number's text is hidden, not its parts.
        "card": {"number": REDACTED, "last4": "4242"},
        "pan": REDACTED,
        "as_float": REDACTED,
        "metadata": {"ref": REDACTED, "ref_text": REDACTED, "quantity": "12", "size": 12},
        "message": f"card {REDACTED} refused",
        "amount": 12,
        "captured": True,
    }
    # The same from the stored request and the full one (the executor's redactor).
    stored = {"card_number": REDACTED, "exp_month": REDACTED, "amount": 12}
    full = {"card_number": PAN, "exp_month": 12, "amount": 12}
    assert Redactor.of(stored, full).json(body) == redactor.json(body)


NESTED_CARD = {"number": CARD, "cvc": "737", "exp_month": 12, "brand": "v"}


def test_the_parts_of_a_hidden_object_are_hidden_by_their_own_names() -> None:
    """A sensitive ``card`` object: its keys become sensitive names, its scalars sensitive
    values by the same rules as a top-level value."""
    redactor = Redactor.for_request(("card",), [NESTED_CARD])
    stored = {"card": REDACTED, "amount": 12}
    assert Redactor.of(stored, {"card": NESTED_CARD, "amount": 12}) == redactor
    body = {
        "source": {"cvc": "737", "exp_month": 12, "number": "tok_1", "brand": None},
        "checks": [{"cvc_check": "pass"}, {"result": "737"}],
        "amount": 12,
        "quantity": "12",
        "style": "v",  # one character, under no sensitive name
        "m": 12,  # a limit: a small number under an unrecognised key stays
        "note": "737 g",
    }
    assert redactor.json(body) == {
        # Under a sensitive name the whole value goes, whatever it is (null stays).
        "source": {"cvc": REDACTED, "exp_month": REDACTED, "number": REDACTED, "brand": None},
        "checks": [{"cvc_check": "pass"}, {"result": "737"}],  # digits, under no such name
        "amount": 12,
        "quantity": "12",
        "style": "v",
        "m": 12,
        "note": "737 g",
    }
    # Only the stored copy left (a status query): the names inside it are not known.
    assert Redactor.of(stored).json(body) == body


def test_a_three_character_text_is_hidden_wherever_a_whole_string_equals_it() -> None:
    redactor = Redactor.for_request(("code", "exp_month", "pin"), ["K9Z", "12", 4])
    body = {
        "reply": "K9Z",
        "lines": ["K9Z", "1K9Z", "K9Z g"],
        "K9Z": "a key",
        "month": "12",
        "n": 4,
    }
    assert redactor.json(body) == {
        "reply": REDACTED,
        "lines": [REDACTED, "1K9Z", "K9Z g"],
        REDACTED: "a key",
        "month": "12",
        "n": 4,
    }
    small = Redactor.for_request(("cvc",), [737])  # a CVC sent as a number: three digits
    assert small.json({"amount": 737, "code": "737", "cvc": 737}) == {
        "amount": 737,
        "code": "737",
        "cvc": REDACTED,
    }


SMALL = st.one_of(
    st.integers(-20, 20),
    st.floats(-20, 20, allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(alphabet="0123456789ab", max_size=3),
    st.sampled_from([2030, "2030", 4321, "4321", 1234567, "0737"]),
)
PLAIN_KEYS = st.sampled_from(["amount", "quantity", "order", "n", "month", "code", "lines"])
BODIES = st.recursive(
    SMALL,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(PLAIN_KEYS, inner, max_size=4),
    max_leaves=20,
)


@given(
    secret=st.integers(-9_999_999, 9_999_999)
    | st.sampled_from([2030, "2030", 4321, "0737", "1234567"])
    | st.text(alphabet="0123456789ab", min_size=1, max_size=2)
    | st.text(alphabet="0123456789", min_size=1, max_size=7),
    body=BODIES,
)
def test_short_sensitive_values_never_garble_a_body_outside_their_names(
    secret: int | str, body: object
) -> None:
    """Whatever numbers and short texts a body holds, equal to the secret or not, they stay
    where no key names a sensitive field: a secret of one or two characters, or a number or
    digit-only text of fewer than eight digits, is looked for only under a sensitive name."""
    redactor = Redactor.for_request(("exp_month",), [secret])
    assert redactor.json(body) == body


@given(
    copies=st.dictionaries(
        st.sampled_from(["card", "order", "note", "card_number_copy", CARD]),
        st.sampled_from([CARD, f"card {CARD}", "12", "o-1", CARD[:6], ""]),
        max_size=4,
    ),
    amount=st.integers(1, 20),
    month=st.integers(1, 12),
)
def test_a_stored_request_without_placeholder_is_the_request_sent(
    copies: dict[str, str], amount: int, month: int
) -> None:
    """``Redactor.redacted_at`` lets a stored request be sent again only when it is exactly
    what was sent; and the card is in it nowhere."""
    registry = Registry()
    registry.register(EXPIRY_CHARGE)
    request = {**expiring_charge("o-1"), "amount": amount, "exp_month": month}
    request.update(description=None, metadata=copies)
    prepared = registry.prepare(
        tenant_id="shop", operation="card.expiring", idempotency_key="k", request=request
    )
    stored = prepared.new.request
    assert stored is not None and stored["amount"] == amount
    assert Redactor.redacted_at(stored) is not None  # the card number itself is redacted
    without = {k: v for k, v in stored.items() if k not in ("card_number", "exp_month")}
    sent = {k: v for k, v in prepared.payload.items() if k not in ("card_number", "exp_month")}
    if Redactor.redacted_at(without) is None:
        assert without == sent
    else:
        assert without != sent
    assert CARD not in str(stored)


def test_redacted_at_names_the_first_placeholder_at_any_depth() -> None:
    assert Redactor.redacted_at({"amount": 12, "metadata": {"order": "o-1"}}) is None
    assert Redactor.redacted_at(None) == "the whole request"
    assert Redactor.redacted_at({"metadata": {"card": REDACTED}}) == "metadata.card"
    assert Redactor.redacted_at({"lines": [{"t": "a"}, {"t": f"x {REDACTED}"}]}) == "lines[1].t"
    assert Redactor.redacted_at({"m": {REDACTED: "v"}}) == f"m.{REDACTED} (a key)"


# -- the whole database, searched for the raw values (PostgreSQL and SQLite) ------------------


def dump(store: Store) -> str:
    """Every table, every column, as text."""
    url = store.engine.url
    if url.get_backend_name() == "sqlite":
        con = sqlite3.connect(str(url.database))
        try:
            return "\n".join(con.iterdump())
        finally:
            con.close()
    parts = []
    pg_dump = shutil.which("pg_dump")
    if pg_dump is not None:
        libpq = url.set(drivername="postgresql").render_as_string(hide_password=False)
        done = subprocess.run(
            [pg_dump, "--data-only", libpq], capture_output=True, text=True, check=False
        )
        if done.returncode == 0:
            parts.append(done.stdout)
    # Also row by row as text, so the check holds without a matching pg_dump.
    inspector = sa.inspect(store.engine)
    with store.engine.connect() as conn:
        for schema in inspector.get_schema_names():
            if schema in ("information_schema", "pg_catalog") or schema.startswith("pg_"):
                continue
            for table in inspector.get_table_names(schema=schema):
                name = f'"{schema}"."{table}"'
                rows = conn.exec_driver_sql(f"SELECT t::text FROM {name} t")
                parts.extend(row[0] for row in rows)
    return "\n".join(parts)


def test_no_sensitive_value_reaches_the_database(
    executor: Executor,
    store: Store,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
) -> None:
    executor.registry.register(CARD_CHARGE)

    def run(key: str, fault: str | None = None) -> str:
        if fault is not None:
            sandbox.inject(fault)
        outcome = executor.execute(
            tenant_id="shop", operation="card.charge", idempotency_key=key, request=charge(key)
        )
        return outcome.operation_id

    answered = run("o-answered")  # the provider's answer echoes the card
    queried = run("o-queried", "drop_after")  # settled by a status query that echoes it
    by_webhook = run("o-webhook", "reset_after")  # settled by a webhook that echoes it
    declined = run("o-declined", "decline")  # a decline's answer and evidence
    make_due(store, queried)
    report = Reconciler(
        store=store,
        providers=[sandbox_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30)),
    ).reconcile_once()
    assert report.picked == 1
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    statuses = [
        handler.handle("shop", "sandbox", d.headers, d.body).status
        for d in sandbox.webhook_deliveries()
    ]
    assert sorted(statuses) == sorted(
        [WebhookStatus.RECORDED] * 3 + [WebhookStatus.APPLIED]  # one event per effect
    )
    states = {op: store.get("shop", op).state for op in (answered, queried, by_webhook)}
    assert set(states.values()) == {State.SUCCEEDED}
    assert store.get("shop", declined).state is State.FAILED_FINAL

    text = dump(store)
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} found in the database"
    # The dump did hold the echoes: their non-sensitive metadata beside the markers.
    assert all(order in text for order in ("o-answered", "o-queried", "o-webhook"))
    assert REDACTED in text


def test_a_status_query_echo_is_redacted_by_name(
    executor: Executor,
    store: Store,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
) -> None:
    """The reconciler has only the stored request: the echo goes by the redacted names."""
    executor.registry.register(CARD_CHARGE)
    sandbox.inject("drop_after")
    op_id = executor.execute(
        tenant_id="shop", operation="card.charge", idempotency_key="k", request=charge("o-7")
    ).operation_id
    make_due(store, op_id)
    Reconciler(
        store=store,
        providers=[sandbox_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30)),
    ).reconcile_once()
    record = store.get("shop", op_id)
    assert record.state is State.SUCCEEDED and record.response is not None
    (effect,) = record.response["provider_response"]["data"]  # the sandbox's listing
    metadata = effect["metadata"]
    assert metadata["card"] == REDACTED and metadata["cardholder"] == REDACTED
    assert metadata["order"] == "o-7"


# -- an expiry year equal to the amount (issue 25) ---------------------------------------------


class YearCharge(BaseModel):
    amount: int
    currency: str
    card: dict[str, object]
    pin: int | None = None
    metadata: dict[str, object] = Field(default_factory=dict)


YEAR_CHARGE = OperationType(
    name="card.year",
    model=YearCharge,
    effect_fields=("amount", "currency"),
    sensitive_fields=("card", "pin"),
    provider="sandbox",
)


@pytest.mark.parametrize("year", [2030, "2030"])
def test_an_amount_equal_to_the_expiry_year_is_stored_as_sent(year: int | str) -> None:
    registry = Registry()
    registry.register(YEAR_CHARGE)
    card = {"number": PAN, "exp_year": year}
    request = {"amount": 2030, "currency": "EUR", "card": card, "pin": 4321}
    request["metadata"] = {"year": year, "ref": str(PAN), "code": 4321, "card_exp_year": year}
    prepared = registry.prepare(
        tenant_id="shop", operation="card.year", idempotency_key="k", request=request
    )
    assert prepared.new.request == {
        "amount": 2030,
        "currency": "EUR",
        "card": REDACTED,
        "pin": REDACTED,
        # A 4-digit PIN or year under a key naming no sensitive field stays (documented);
        # the 16-digit card number goes anywhere.
        "metadata": {"year": year, "ref": REDACTED, "code": 4321, "card_exp_year": REDACTED},
    }
    redactor = Redactor.of(prepared.new.request, prepared.payload)
    body = {"amount": 2030, "note": f"due {year}", "pan": PAN, "pin": 4321, "exp_year": year}
    assert redactor.json(body) == {
        "amount": 2030,
        "note": f"due {year}",
        "pan": REDACTED,
        "pin": REDACTED,
        "exp_year": REDACTED,
    }
    answer = Answer(kind=AnswerKind.DECLINED, message=f"card {PAN} refused", body=body)
    assert redactor.answer(answer).message == f"card {REDACTED} refused"


def test_the_effect_fields_are_stored_as_sent_even_if_a_sensitive_value_equals_one() -> None:
    """A sensitive card object holding ``"EUR"`` no longer hides the effect ``currency``."""
    registry = Registry()
    registry.register(YEAR_CHARGE)
    card = {"number": PAN, "currency": "EUR", "amount": 2030}
    prepared = registry.prepare(
        tenant_id="shop",
        operation="card.year",
        idempotency_key="k",
        request={"amount": 2030, "currency": "EUR", "card": card},
    )
    stored = prepared.new.request
    assert stored is not None and stored["amount"] == 2030 and stored["currency"] == "EUR"
    assert Redactor.redacted_at({k: v for k, v in stored.items() if k != "card"}) is None
