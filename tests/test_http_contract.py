"""The HTTP contract (docs/http.md): the Idempotency-Key header, every row of the answer
table, RFC 9457 problem bodies, and a Retry-After on every 409 and 503."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import RecordingSleep
from hypothesis import given
from hypothesis import strategies as st

from payorch import WebhookHandler, WebhookResult, WebhookStatus, errors
from payorch.core import MAX_KEY_LENGTH, State
from payorch.errors import (
    InvalidIdempotencyKey,
    OperationInProgress,
    PayorchError,
    RequestBodyNotJson,
    RequestValidationFailed,
    UnknownProvider,
    WebhookSignatureInvalid,
)
from payorch.execution._executor import Executor
from payorch.http import (
    IDEMPOTENCY_KEY_HEADER,
    JSON,
    PROBLEM_JSON,
    HttpAnswer,
    http_answer,
    parse_idempotency_key,
    parse_json_body,
    problem,
    webhook_answer,
)
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._claims import IN_PROGRESS_RETRY_CAP
from payorch.storage._store import Store
from payorch.storage._tables import operations

PAYMENT = {"amount": 990, "currency": "EUR", "customer": "cus_3"}
KEY_CHARS = "".join(chr(c) for c in range(0x21, 0x7F))  # what payorch accepts as a key
RFC9457 = ("type", "title", "status", "detail")

valid_keys = st.text(alphabet=KEY_CHARS, min_size=1, max_size=MAX_KEY_LENGTH)
ows = st.sampled_from(["", " ", "  ", "\t", " \t"])


def quoted(key: str) -> str:
    """The RFC 8941 sf-string form of ``key``."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- the header ----------------------------------------------------------------------------


def test_the_header_name() -> None:
    assert IDEMPOTENCY_KEY_HEADER == "Idempotency-Key"


@given(key=valid_keys, before=ows, after=ows)
def test_the_quoted_form_of_any_valid_key_is_that_key(key: str, before: str, after: str) -> None:
    assert parse_idempotency_key(before + quoted(key) + after) == key


@given(key=valid_keys.filter(lambda k: not set(k) & set(',"')), before=ows, after=ows)
def test_the_bare_form_is_the_same_key_as_the_quoted_form(
    key: str, before: str, after: str
) -> None:
    assert parse_idempotency_key(before + key + after) == parse_idempotency_key(quoted(key))


@given(
    head=st.text(alphabet=KEY_CHARS.replace('"', ""), min_size=1, max_size=20),
    tail=st.text(alphabet=KEY_CHARS, max_size=20),
    bad=st.sampled_from([",", ", ", " ", "\t"]),
)
def test_a_bare_value_with_a_comma_or_whitespace_inside_is_refused(
    head: str, tail: str, bad: str
) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        parse_idempotency_key(head + bad + (tail or "x"))


@given(
    key=valid_keys,
    odd=st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, exclude_categories=["Cs"]),
    at=st.integers(min_value=0),
    quote=st.booleans(),
)
def test_anything_non_ascii_is_refused(key: str, odd: str, at: int, quote: bool) -> None:
    at %= len(key) + 1
    text = key[:at] + odd + key[at:]
    with pytest.raises(InvalidIdempotencyKey, match="ASCII"):
        parse_idempotency_key(quoted(text) if quote else text)


@given(a=valid_keys, b=valid_keys)
def test_a_list_of_quoted_keys_is_refused(a: str, b: str) -> None:
    with pytest.raises(InvalidIdempotencyKey, match="several values"):
        parse_idempotency_key(f"{quoted(a)}, {quoted(b)}")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "missing"),
        ("", "empty"),
        ("   ", "empty"),
        ('""', "empty"),
        ("a, b", "several values"),
        ('"a", "b"', "several values"),
        ("a,b", "several values"),
        ('"a";p=1', "parameters"),
        ('"a";secret', "parameters"),
        ('"abc', "badly quoted"),
        ('ab"c', "badly quoted"),
        ('abc"', "badly quoted"),
        ('"a" b', "badly quoted"),
        ('"a\\x"', "badly quoted"),  # only \" and \\ are escapes
        ('%"abc"', "badly quoted"),
        ("a b", "whitespace"),
        ('"a b"', "without spaces"),
        ("café", "ASCII"),
        ('"café"', "ASCII"),
        ("k\x00", "control"),
        ('"k\x7f"', "control"),
        ("x" * (MAX_KEY_LENGTH + 1), "longer than"),
        (quoted("x" * (MAX_KEY_LENGTH + 1)), "longer than"),
        ("x" * (2 * MAX_KEY_LENGTH + 3), "too long"),
    ],
)
def test_bad_headers_are_refused_with_a_reason(value: str | None, why: str) -> None:
    with pytest.raises(InvalidIdempotencyKey, match=why) as info:
        parse_idempotency_key(value)
    answer = http_answer(info.value)
    assert answer.status == 400 and answer.content_type == PROBLEM_JSON
    assert answer.body["type"] == "urn:payorch:problem:invalid-idempotency-key"


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ('"a\\"b\\\\c"', 'a"b\\c'),
        ('"a,b"', "a,b"),  # a comma inside the quotes is part of the key
        ("k;p=1", "k;p=1"),  # a bare value is taken verbatim
        (":YWJj:", ":YWJj:"),  # never read as an sf byte sequence
        ("?1", "?1"),
        ("42", "42"),
        (quoted("x" * MAX_KEY_LENGTH), "x" * MAX_KEY_LENGTH),
        (quoted('"' * MAX_KEY_LENGTH), '"' * MAX_KEY_LENGTH),
    ],
)
def test_good_headers(value: str, key: str) -> None:
    assert parse_idempotency_key(value) == key


def test_the_header_rule_is_the_rule_execute_applies() -> None:
    registry = default_registry("sandbox")
    for value in ['"a b"', '""', quoted("x" * (MAX_KEY_LENGTH + 1))]:
        with pytest.raises(InvalidIdempotencyKey) as from_header:
            parse_idempotency_key(value)
        inner = value[1:-1]
        with pytest.raises(InvalidIdempotencyKey) as from_execute:
            registry.prepare(
                tenant_id="shop", operation="payment.create", idempotency_key=inner, request=PAYMENT
            )
        assert from_header.value.message == from_execute.value.message


# -- the body ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"amount=1",
        b"{",
        b'{"amount": 1,}',
        b"\xff\xfe{}",
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b'{"amount": 1, "amount": 1000}',
        b"[" * 100_000,
    ],
)
def test_a_body_that_is_not_json_is_a_400_problem(raw: bytes) -> None:
    with pytest.raises(RequestBodyNotJson) as info:
        parse_json_body(raw)
    answer = http_answer(info.value)
    assert (answer.status, answer.content_type) == (400, PROBLEM_JSON)
    assert answer.body["type"] == "urn:payorch:problem:request-body-not-json"


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"x"', b"null"])
def test_json_that_is_not_an_object_is_a_422_validation_problem(raw: bytes) -> None:
    with pytest.raises(RequestValidationFailed) as info:
        parse_json_body(raw)
    answer = http_answer(info.value)
    assert answer.status == 422 and answer.body["errors"][0]["type"] == "model_type"


def test_a_json_object_is_the_request() -> None:
    assert parse_json_body('{"amount": 990, "meta": {"a": [1]}}') == {
        "amount": 990,
        "meta": {"a": [1]},
    }


# -- problem bodies and Retry-After ---------------------------------------------------------

SPECIAL: dict[str, dict[str, Any]] = {
    "OperationInProgress": {"operation_id": "op", "retry_after": 2.2},
    "CorruptRecord": {"tenant_id": "t", "operation_id": "op", "problem": "json"},
    "EffectFailed": {"effect_id": "eff", "error_type": "Refused", "error_message": "no"},
    "EffectOutcomeUnknown": {"effect_id": "eff"},
    "SettlementReportInvalid": {"file": "day-1.csv", "row": 2, "column": "gross"},
    "NoRoute": {"operation": "payment.create"},
}


def every_error() -> Iterator[PayorchError]:
    for name in errors.__all__:
        cls: type[PayorchError] = getattr(errors, name)
        yield cls("internal words", **SPECIAL.get(name, {}))


def assert_problem(answer: HttpAnswer, err: PayorchError) -> None:
    assert answer.content_type == PROBLEM_JSON
    assert list(answer.body)[:4] == list(RFC9457)
    assert answer.body["type"] == err.problem_type
    assert answer.body["status"] == answer.status
    assert isinstance(answer.body["title"], str) and answer.body["title"]
    assert isinstance(answer.body["detail"], str) and answer.body["detail"]
    assert json.loads(answer.content()) == answer.body
    assert answer.content() == json.dumps(answer.body, separators=(",", ":")).encode()


@pytest.mark.parametrize("err", list(every_error()), ids=lambda e: type(e).__name__)
def test_every_error_is_an_rfc9457_problem(err: PayorchError) -> None:
    answer = http_answer(err)
    assert_problem(answer, err)
    assert answer.status == err.http_status
    if answer.status in (202, 409, 503):  # 202: an effect escalated, ask again later
        assert int(answer.headers["Retry-After"]) >= 1
    if answer.status >= 500:
        # Internals (hosts, SQL, configuration) stay on the exception; the same key is safe.
        assert "internal words" not in answer.body["detail"]
        assert answer.body["retry"] == "same_key"
    assert answer.body.get("retry") != "new_key"  # no error ever invites a new key
    assert answer.body.get("operation_id") == err.operation_id
    assert answer.headers.get("Payorch-Operation-Id") == err.operation_id


def test_problem_titles_are_stable_per_type() -> None:
    titles = {http_answer(e).body["title"] for e in every_error()}
    assert len(titles) == len(errors.__all__)
    assert http_answer(RequestBodyNotJson("x")).body["title"] == "Request body not JSON"


def test_the_in_progress_problem_says_when_and_with_which_key() -> None:
    answer = http_answer(OperationInProgress("busy", operation_id="op-9", retry_after=2.2))
    assert answer.status == 409 and answer.headers["Retry-After"] == "3"
    assert answer.body["retry"] == "same_key" and answer.body["operation_id"] == "op-9"


def test_a_validation_problem_lists_its_errors() -> None:
    err = RequestValidationFailed(
        "amount", errors=[{"loc": ["amount"], "msg": "bad", "type": "int_type"}]
    )
    answer = http_answer(err)
    assert answer.status == 422
    assert answer.body["errors"] == [{"loc": ["amount"], "msg": "bad", "type": "int_type"}]


def test_problem_helper() -> None:
    answer = problem(400, "urn:x:y", "Y", "why", extra=1)
    assert answer.body == {
        "type": "urn:x:y",
        "title": "Y",
        "status": 400,
        "detail": "why",
        "extra": 1,
    }
    assert (answer.content_type, answer.headers) == (PROBLEM_JSON, {})
    for status in (409, 503):
        assert problem(status, "urn:x:y", "Y", "why").headers["Retry-After"] == "1"
    kept = problem(503, "urn:x:y", "Y", "why", headers={"Retry-After": "7"})
    assert kept.headers["Retry-After"] == "7"


def test_success_status_is_200_or_201() -> None:
    with pytest.raises(errors.ConfigurationError):
        http_answer(errors.InvalidRequest("x"), success_status=204)


# -- outcomes, one row each (pure) ---------------------------------------------------------


def outcome(state: State, *, replayed: bool = False, **response: Any) -> Outcome:
    status = {"succeeded": 200, "failed_final": 402, "outcome_unknown": 202}.get(state, 409)
    return Outcome(
        operation_id="op-1",
        tenant_id="shop",
        operation="payment.create",
        state=state,
        replayed=replayed,
        http_status=response.get("http_status", status),
        provider_reference=None,
        error_code=None,
        response=response or None,
        needs_attention=False,
    )


ROWS: list[tuple[str, Outcome, int, dict[str, str], str | None]] = [
    # name, outcome, status, headers that must be there, body["retry"]
    ("fresh success", outcome(State.SUCCEEDED, status="succeeded", http_status=200), 201, {}, None),
    (
        "replayed success",
        outcome(State.SUCCEEDED, replayed=True, http_status=200),
        201,
        {"Idempotent-Replayed": "true"},
        None,
    ),
    ("declined", outcome(State.FAILED_FINAL, code="card_declined", http_status=402), 402, {}, None),
    (
        "replayed decline",
        outcome(State.FAILED_FINAL, replayed=True, http_status=402),
        402,
        {"Idempotent-Replayed": "true"},
        None,
    ),
    (
        # Stored by an earlier version (nothing sent is released now): its client was told
        # to use a new key, so the key stays closed: final, never a 503 that loops.
        "nothing sent, stored earlier",
        outcome(State.FAILED_FINAL, code="provider_unavailable", http_status=503),
        402,
        {},
        None,
    ),
    ("unknown", outcome(State.OUTCOME_UNKNOWN), 202, {"Location": "/ops/op-1"}, "same_key"),
    ("taken over", outcome(State.IN_PROGRESS), 409, {"Retry-After": "1"}, "same_key"),
]


@pytest.mark.parametrize(
    ("name", "result", "status", "headers", "retry"), ROWS, ids=[r[0] for r in ROWS]
)
def test_every_outcome_row(
    name: str, result: Outcome, status: int, headers: dict[str, str], retry: str | None
) -> None:
    answer = http_answer(result, success_status=201, location="/ops/op-1")
    assert answer.status == status
    assert answer.content_type == JSON
    assert answer.headers["Payorch-Operation-Id"] == "op-1"
    assert answer.headers.items() >= headers.items()
    assert ("Idempotent-Replayed" in answer.headers) is result.replayed
    assert answer.body.get("retry") == retry
    assert answer.body["operation_id"] == "op-1" and answer.body["state"] == result.state.value
    assert "http_status" not in answer.body
    assert ("Location" in answer.headers) is (status in (201, 202))


def test_success_is_200_by_default_and_a_409_always_says_when() -> None:
    assert http_answer(outcome(State.SUCCEEDED, http_status=200)).status == 200
    assert http_answer(outcome(State.OUTCOME_UNKNOWN)).headers.get("Location") is None
    assert "Retry-After" in http_answer(outcome(State.IN_PROGRESS)).headers


# -- webhooks ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", list(WebhookStatus))
def test_every_handled_webhook_is_200(status: WebhookStatus) -> None:
    result = WebhookResult(
        status=status, event_id="evt_1", operation_id="op-1", state=State.SUCCEEDED
    )
    answer = webhook_answer(result)
    assert (answer.status, answer.content_type) == (200, JSON)
    assert answer.body == {
        "status": status.value,
        "event_id": "evt_1",
        "operation_id": "op-1",
        "state": "succeeded",
    }


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (WebhookSignatureInvalid("bad signature"), 400),
        (errors.WebhookMalformed("not json"), 400),
        (UnknownProvider("no provider named 'acme'"), 404),
        (errors.InvalidTenant("bad tenant"), 400),
        (errors.DatabaseUnavailable("db down", retry_after=2), 503),
        (errors.StaleVersion("kept changing", operation_id="op-1"), 409),
    ],
)
def test_webhook_refusals(err: PayorchError, status: int) -> None:
    answer = webhook_answer(err)
    assert answer.status == status and answer.content_type == PROBLEM_JSON
    assert answer.body["status"] == status and answer.body["type"] == err.problem_type
    if status in (409, 503):
        assert int(answer.headers["Retry-After"]) >= 1


# -- end to end through execute() and the webhook handler (SQLite and PostgreSQL) -------------


@pytest.fixture
def ex(store: Store, sandbox_provider: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=120),
        sleep=RecordingSleep(),
    )


def serve(ex: Executor, header: str | None, body: bytes) -> HttpAnswer:
    """What an integration does: parse, execute, answer (201 + Location)."""
    try:
        key = parse_idempotency_key(header)
        outcome = ex.execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key=key,
            request=parse_json_body(body),
        )
    except PayorchError as refused:
        return http_answer(refused)
    return http_answer(outcome, success_status=201, location=f"/ops/{outcome.operation_id}")


def count(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar_one())


def test_quoted_and_bare_forms_are_one_operation(
    ex: Executor, store: Store, sandbox: SandboxServer
) -> None:
    body = json.dumps(PAYMENT).encode()
    first = serve(ex, '"8e03978e-40d5-43e8-bc93-6894a57f9324"', body)
    again = serve(ex, "8e03978e-40d5-43e8-bc93-6894a57f9324", body)
    assert (first.status, again.status) == (201, 201)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content() == first.content()
    assert first.headers["Location"] == f"/ops/{first.body['operation_id']}"
    assert len(sandbox.ledger()) == 1 and count(store) == 1


@pytest.mark.parametrize(
    ("header", "body", "status", "type_"),
    [
        (None, PAYMENT, 400, "invalid-idempotency-key"),
        ('"a", "b"', PAYMENT, 400, "invalid-idempotency-key"),
        ("k", b"{not json", 400, "request-body-not-json"),
        ("k", {**PAYMENT, "amount": "lots"}, 422, "request-validation-failed"),
    ],
)
def test_bad_input_is_a_4xx_problem_and_writes_nothing(
    ex: Executor,
    store: Store,
    sandbox: SandboxServer,
    header: str | None,
    body: Any,
    status: int,
    type_: str,
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = serve(ex, header, raw)
    assert (answer.status, answer.content_type) == (status, PROBLEM_JSON)
    assert answer.body["type"] == f"urn:payorch:problem:{type_}"
    assert count(store) == 0 and sandbox.ledger() == []


def test_reused_key_is_422_told_apart_by_type(ex: Executor, sandbox: SandboxServer) -> None:
    serve(ex, "k", json.dumps(PAYMENT).encode())
    answer = serve(ex, "k", json.dumps({**PAYMENT, "amount": 991}).encode())
    assert answer.status == 422
    assert answer.body["type"] == "urn:payorch:problem:idempotency-key-reused"
    assert "retry" not in answer.body  # never "use a new key"
    assert len(sandbox.ledger()) == 1


def test_unknown_is_202_with_location_then_a_webhook_settles_the_replay(
    ex: Executor, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    sandbox.inject("drop_after")
    body = json.dumps(PAYMENT).encode()
    unknown = serve(ex, '"order-7"', body)
    op_id = unknown.body["operation_id"]
    assert unknown.status == 202 and unknown.body["state"] == "outcome_unknown"
    assert unknown.headers["Location"] == f"/ops/{op_id}"
    assert unknown.headers["Payorch-Operation-Id"] == op_id
    assert unknown.body["retry"] == "same_key"
    (delivery,) = sandbox.webhook_deliveries()
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    hook = webhook_answer(handler.handle("shop", "sandbox", delivery.headers, delivery.body))
    assert hook.status == 200 and hook.body["status"] == "applied"
    final = serve(ex, "order-7", body)
    assert final.status == 201 and final.body["state"] == "succeeded"
    assert final.headers["Idempotent-Replayed"] == "true"
    assert len(sandbox.ledger()) == 1


def test_webhook_for_an_unknown_provider_is_404_and_a_bad_signature_400(
    store: Store, sandbox_provider: SandboxProvider
) -> None:
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    for provider, headers, status in [("acme", {}, 404), ("sandbox", {"webhook-id": "e"}, 400)]:
        try:
            result: WebhookResult | PayorchError = handler.handle("shop", provider, headers, b"{}")
        except PayorchError as exc:
            result = exc
        answer = webhook_answer(result)
        assert (answer.status, answer.content_type) == (status, PROBLEM_JSON)


def set_row(store: Store, op_id: str, **values: Any) -> None:
    with store.engine.begin() as conn:
        conn.execute(sa.update(operations).where(operations.c.id == op_id).values(**values))


def busy(ex: Executor) -> OperationInProgress:
    with pytest.raises(OperationInProgress) as info:
        ex.execute(
            tenant_id="shop", operation="payment.create", idempotency_key="busy", request=PAYMENT
        )
    return info.value


def test_409_looks_again_soon_not_after_the_whole_lease(ex: Executor, store: Store) -> None:
    new = (
        default_registry("sandbox")
        .prepare(
            tenant_id="shop", operation="payment.create", idempotency_key="busy", request=PAYMENT
        )
        .new
    )
    op_id = store.claim(new, owner="someone", lease=timedelta(seconds=120)).operation.id
    answer = http_answer(busy(ex))
    # A 120 s lease and an attempt that just started: look again in a moment, not in 2 min.
    assert answer.status == 409
    assert 1 <= int(answer.headers["Retry-After"]) <= IN_PROGRESS_RETRY_CAP
    assert answer.body["operation_id"] == op_id and answer.body["retry"] == "same_key"
    now = datetime.now(UTC)
    # An attempt running for a minute: look again after the cap.
    set_row(store, op_id, updated_at=now - timedelta(seconds=60))
    assert busy(ex).retry_after == IN_PROGRESS_RETRY_CAP
    # Running for 3 s: about as long again.
    set_row(store, op_id, updated_at=now - timedelta(seconds=3))
    assert 3.0 <= busy(ex).retry_after <= IN_PROGRESS_RETRY_CAP
    # A lease about to lapse: no later than its expiry.
    soon = now + timedelta(seconds=2)
    set_row(store, op_id, updated_at=now - timedelta(seconds=60), lease_expires_at=soon)
    err = busy(ex)
    assert 1.0 <= err.retry_after <= 2.0
    assert 1 <= int(http_answer(err).headers["Retry-After"]) <= 2
    assert len(store.events("shop", op_id)) >= 1  # the holder's operation, untouched by us
    assert store.get("shop", op_id).lease_owner == "someone"


def test_the_letters_of_the_key_alphabet() -> None:
    # The Hypothesis alphabet above is exactly payorch's key rule.
    assert set(KEY_CHARS) == set(string.printable) - set(string.whitespace)
