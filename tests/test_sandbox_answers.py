"""SandboxProvider's answers to odd replies and transport errors, through MockTransport."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sandbox_helpers import DK_1, query, request

from payorch.provider import RAW_EVIDENCE_LIMIT, Answer, AnswerKind
from payorch.providers.sandbox import DEFAULT_TIMEOUT, SandboxProvider

# -- odd answers through MockTransport ---------------------------------------------------


def mocked(handler: Callable[[httpx.Request], httpx.Response]) -> SandboxProvider:
    return SandboxProvider(base_url="http://sandbox.test", transport=httpx.MockTransport(handler))


def answer_for(response: httpx.Response, *, as_query: bool = False) -> Answer:
    with mocked(lambda r: response) as provider:
        return provider.query_status(query()) if as_query else provider.submit(request())


def test_the_request_is_what_the_server_expects() -> None:
    seen: list[httpx.Request] = []

    def handler(r: httpx.Request) -> httpx.Response:
        seen.append(r)
        return httpx.Response(200, json={"id": "sbx_1", "status": "succeeded"})

    with mocked(handler) as provider:
        provider.submit(request())
        provider.query_status(query())
        provider.query_status(query(reference="sbx/1"))
    post, by_key, by_ref = seen
    assert post.method == "POST"
    assert post.url == "http://sandbox.test/v1/operations/payment.create"
    assert post.headers["idempotency-key"] == DK_1
    assert json.loads(post.content)["metadata"] == request().tags
    assert set(request().tags) == {
        "payorch_ref",
        "payorch_tenant_id",
        "payorch_operation",
        "payorch_idempotency_key",
        "payorch_fingerprint",
    }
    assert by_key.url.path == "/v1/effects"
    assert dict(by_key.url.params) == {"idempotency_key": DK_1}
    assert by_ref.url.raw_path == b"/v1/effects/sbx%2F1"
    assert post.extensions["timeout"] == DEFAULT_TIMEOUT.as_dict()


@pytest.mark.parametrize(
    "body", [b"<html>oops</html>", b"", b'{"status": "succeeded"}', b'["id"]', b"x" * 10_000]
)
def test_200_without_an_effect_is_ambiguous(body: bytes) -> None:
    answer = answer_for(httpx.Response(200, content=body))
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.status_code == 200
    assert answer.code == "unexpected_body"
    if answer.body is None:
        assert answer.raw is not None and len(answer.raw) <= RAW_EVIDENCE_LIMIT


def test_200_with_an_unknown_status_is_ambiguous() -> None:
    answer = answer_for(httpx.Response(200, json={"id": "sbx_1", "status": "reversed"}))
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.provider_reference == "sbx_1"


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_5xx_is_ambiguous_with_raw_evidence(status: int) -> None:
    for as_query in (False, True):
        answer = answer_for(httpx.Response(status, text="<h1>Bad Gateway</h1>"), as_query=as_query)
        assert answer.kind is AnswerKind.AMBIGUOUS
        assert answer.status_code == status
        assert answer.raw == "<h1>Bad Gateway</h1>"


def test_429_on_query_is_not_sent() -> None:
    answer = answer_for(httpx.Response(429, headers={"Retry-After": "4"}), as_query=True)
    assert answer.kind is AnswerKind.NOT_SENT
    assert answer.retry_after == 4.0


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (400, {"error": {"type": "invalid_request_error", "code": "amount_too_small"}}, None),
    ],
)
def test_a_4xx_the_acquirer_explains_is_declined(status: int, body: Any, code: str | None) -> None:
    answer = answer_for(httpx.Response(status, content=json.dumps(body).encode()))
    assert answer.kind is AnswerKind.DECLINED
    assert answer.status_code == status
    assert answer.code == (code or body["error"]["code"])


def test_a_401_is_a_configuration_fault_never_a_decline() -> None:
    body = {"error": {"type": "authentication_error", "code": "bad_key"}}
    answer = answer_for(httpx.Response(401, content=json.dumps(body).encode()))
    assert (answer.kind, answer.code) == (AnswerKind.NOT_SENT, "provider_auth_failed")


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, b"not found"),
        (408, b""),
        (409, json.dumps({"error": {"type": "idempotency_error", "code": "other"}}).encode()),
        (499, b"<html>proxy</html>"),
    ],
)
def test_a_4xx_without_the_acquirers_reason_is_ambiguous(status: int, body: bytes) -> None:
    # Possibly from a proxy in front of the acquirer, after it committed: never final.
    answer = answer_for(httpx.Response(status, content=body))
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.status_code == status


def test_odd_query_answers_are_ambiguous() -> None:
    assert answer_for(httpx.Response(400, json={}), as_query=True).kind is AnswerKind.AMBIGUOUS
    assert answer_for(httpx.Response(200, json={"x": 1}), as_query=True).kind is (
        AnswerKind.AMBIGUOUS
    )
    assert answer_for(httpx.Response(200, text="nope"), as_query=True).kind is (
        AnswerKind.AMBIGUOUS
    )
    # 404 by key (no such route) is not "the provider knows nothing".
    assert answer_for(httpx.Response(404), as_query=True).kind is AnswerKind.AMBIGUOUS


def test_a_redirect_is_ambiguous() -> None:
    answer = answer_for(httpx.Response(302, headers={"Location": "/elsewhere"}))
    assert answer.kind is AnswerKind.AMBIGUOUS
    assert answer.code == "http_302"


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("refused"), AnswerKind.NOT_SENT),
        (httpx.ConnectTimeout("slow"), AnswerKind.NOT_SENT),
        (httpx.PoolTimeout("busy"), AnswerKind.NOT_SENT),
        (httpx.ReadTimeout("slow"), AnswerKind.AMBIGUOUS),
        (httpx.WriteTimeout("slow"), AnswerKind.AMBIGUOUS),
        (httpx.RemoteProtocolError("eof"), AnswerKind.AMBIGUOUS),
        (httpx.ReadError("reset"), AnswerKind.AMBIGUOUS),
    ],
)
def test_transport_errors_never_escape(exc: httpx.HTTPError, kind: AnswerKind) -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        raise exc

    with mocked(handler) as provider:
        assert provider.submit(request()).kind is kind
        assert provider.query_status(query()).kind is kind
