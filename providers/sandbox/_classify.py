"""How the sandbox acquirer's answers read: submissions, status queries, voids and listed
effects, each classified into one :class:`payorch.provider.Answer` kind (no I/O)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import httpx

from ...errors import ProviderIdempotencyError
from ...provider import (
    Answer,
    AnswerKind,
    ProviderEffect,
    SubmitRequest,
    answer_from_http_status,
    bounded_object,
    bounded_raw,
    listing_failed,
    parse_retry_after,
    payorch_tags_of,
    unix_time,
)

__all__ = [
    "EVENT_KINDS",
    "VOIDED",
    "classify_query",
    "classify_submit",
    "classify_void",
    "error_of",
    "listed_effect",
    "read_reply",
    "str_or_none",
]

_EFFECT_KINDS = {
    "succeeded": AnswerKind.SUCCEEDED,
    "declined": AnswerKind.DECLINED,
    "processing": AnswerKind.PENDING,
    # Released before capture: no money moved (a void's outcome, code "voided").
    "voided": AnswerKind.DECLINED,
}
EVENT_KINDS = {
    "effect.succeeded": AnswerKind.SUCCEEDED,
    "effect.declined": AnswerKind.DECLINED,
    "effect.processing": AnswerKind.PENDING,
    "effect.voided": AnswerKind.DECLINED,
}
VOIDED = "voided"  # the code and lifecycle of a voided authorisation
# When one key has several effects (it was reused past the window), money that moved wins.
_PRECEDENCE = {AnswerKind.SUCCEEDED: 0, AnswerKind.PENDING: 1, AnswerKind.DECLINED: 2}


def _json_object(content: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(content)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return parsed if isinstance(parsed, dict) else None


def error_of(body: Mapping[str, Any] | None) -> Mapping[str, Any]:
    error = body.get("error") if body is not None else None
    return error if isinstance(error, Mapping) else {}


def str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def classify_submit(response: httpx.Response, request: SubmitRequest) -> Answer:
    """What the sandbox's answer to a submission says."""
    status, body, evidence, shared = read_reply(response)
    if shared is not None:
        return shared
    if 200 <= status < 300:
        return _from_effect(body, evidence)
    error = error_of(body)
    code = str_or_none(error.get("code"))
    message = str_or_none(error.get("message"))
    if status == 400 and code == "idempotency_key_reused":
        raise ProviderIdempotencyError(
            "the sandbox saw this downstream key with another request",
            operation_id=request.operation_id,
        )
    if status == 409 and code == "request_in_progress":
        # Our own earlier attempt is still executing there: this one did nothing.
        return Answer(
            kind=AnswerKind.NOT_SENT,
            retry_after=parse_retry_after(response.headers.get("retry-after")),
            code=code,
            message=message,
            **evidence,
        )
    if 400 <= status < 500 and _is_refusal(status, error):
        decline_code = str_or_none(error.get("decline_code"))
        return Answer(
            kind=AnswerKind.DECLINED,
            provider_reference=str_or_none(error.get("effect_id")),
            code=decline_code or code or f"http_{status}",
            message=message,
            **evidence,
        )
    # 1xx / 3xx, or a 4xx without the sandbox's error object (a proxy's page, a 408):
    # not an answer we understand, and possibly sent.
    return Answer(kind=AnswerKind.AMBIGUOUS, code=f"http_{status}", **evidence)


def classify_query(response: httpx.Response, *, by_reference: bool) -> Answer:
    """What the sandbox's answer to a status query says."""
    status, body, evidence, shared = read_reply(response)
    if shared is not None:
        return shared
    if status == 404 and by_reference:
        return Answer(kind=AnswerKind.NOT_FOUND, code="resource_missing", **evidence)
    if status != 200 or body is None:
        # A read that failed oddly is not evidence of anything.
        return Answer(kind=AnswerKind.AMBIGUOUS, code=f"http_{status}", **evidence)
    if by_reference:
        return _from_effect(body, evidence)
    return _from_listing(body, evidence)


def _from_listing(body: Mapping[str, Any], evidence: dict[str, Any]) -> Answer:
    data = body.get("data")
    if not isinstance(data, list):
        return Answer(kind=AnswerKind.AMBIGUOUS, code="unexpected_body", **evidence)
    if not data:
        return Answer(kind=AnswerKind.NOT_FOUND, **evidence)
    answers = [_from_effect(e if isinstance(e, dict) else None, evidence) for e in data]
    best = min(answers, key=lambda a: _PRECEDENCE.get(a.kind, len(_PRECEDENCE)))
    if len(data) > 1:
        # The key was reused past the window: more than one effect. Say so in evidence,
        # and name the others so the reconciler can flag the duplicate.
        refs = dict.fromkeys(a.provider_reference for a in answers if a.provider_reference)
        others = tuple(r for r in refs if r != best.provider_reference)
        return replace(best, message=f"{len(data)} effects for this key", duplicates=others)
    return best


def _from_effect(effect: Mapping[str, Any] | None, evidence: dict[str, Any]) -> Answer:
    """SUCCEEDED / DECLINED / PENDING from an effect; AMBIGUOUS if it is not one."""
    effect_id = str_or_none(effect.get("id")) if effect is not None else None
    status = str_or_none(effect.get("status")) if effect is not None else None
    if effect is None or effect_id is None or status is None:
        return Answer(kind=AnswerKind.AMBIGUOUS, code="unexpected_body", **evidence)
    kind = _EFFECT_KINDS.get(status, AnswerKind.AMBIGUOUS)
    code = None
    if kind is AnswerKind.DECLINED:
        code = str_or_none(effect.get("decline_code")) or "declined"
    elif kind is AnswerKind.AMBIGUOUS:
        code = f"unexpected_status:{status}"[:64]
    return Answer(kind=kind, provider_reference=effect_id, code=code, **evidence)


def classify_void(response: httpx.Response) -> Answer:
    status, body, evidence, shared = read_reply(response)
    if shared is not None:
        return shared
    error = error_of(body)
    code = str_or_none(error.get("code"))
    if status == 409 and code == "request_in_progress":
        # The payment itself is being made right now: nothing was voided; send it again.
        retry = parse_retry_after(response.headers.get("retry-after"))
        return Answer(kind=AnswerKind.NOT_SENT, status_code=409, retry_after=retry, code=code)
    if status == 400 and code == "already_captured":
        effect = error.get("effect")
        ref = str_or_none(effect.get("id")) if isinstance(effect, dict) else None
        return Answer(kind=AnswerKind.DECLINED, provider_reference=ref, code=code, **evidence)
    if status != 200 or not isinstance(body, dict):
        return Answer(kind=AnswerKind.AMBIGUOUS, code=f"http_{status}", **evidence)
    effect = body.get("effect")
    ref = str_or_none(effect.get("id")) if isinstance(effect, dict) else None
    kind, code = _VOID_RESULTS.get(body.get("status"), (AnswerKind.AMBIGUOUS, "unexpected_body"))
    return Answer(kind=kind, provider_reference=ref, code=code, **evidence)


_VOID_RESULTS: Mapping[object, tuple[AnswerKind, str]] = {
    "voided": (AnswerKind.SUCCEEDED, VOIDED),
    # Nothing was made under the key, and the sandbox now refuses anything under it: void.
    "nothing_found": (AnswerKind.SUCCEEDED, "nothing_found"),
}


def listed_effect(provider: str, item: object) -> ProviderEffect:
    """One listed ledger entry; ``ProviderListingFailed`` if it is not one."""
    entry: Mapping[str, Any] = item if isinstance(item, dict) else {}
    effect_id = str_or_none(entry.get("id"))
    status = str_or_none(entry.get("status"))
    amount = entry.get("amount")
    created = entry.get("created")
    created_at = unix_time(created) if isinstance(created, int) else None
    if effect_id is None or status is None or created_at is None:
        raise listing_failed(
            provider,
            Answer(
                kind=AnswerKind.AMBIGUOUS,
                code="unexpected_body",
                message="a listed effect without an id, a status or a creation time",
            ),
        )
    kind = _EFFECT_KINDS.get(status, AnswerKind.AMBIGUOUS)
    return ProviderEffect(
        provider_reference=effect_id,
        kind=kind,
        amount=amount if isinstance(amount, int) and not isinstance(amount, bool) else None,
        currency=str_or_none(entry.get("currency")),
        created_at=created_at,
        tags=payorch_tags_of(entry.get("metadata")),
        object_type=str_or_none(entry.get("object")) or "effect",
        downstream_key=str_or_none(entry.get("idempotency_key")),
        code=(str_or_none(entry.get("decline_code")) or "declined")
        if kind is AnswerKind.DECLINED
        else None,
        raw=bounded_object(entry),
    )


# The sandbox's own refusals, all decided before it commits anything.
_REFUSAL_TYPES = frozenset({"card_error", "invalid_request_error", "authentication_error"})


def _is_refusal(status: int, error: Mapping[str, Any]) -> bool:
    """A 4xx is final only when the acquirer itself says why; anything else may be a proxy."""
    return status != 408 and str_or_none(error.get("type")) in _REFUSAL_TYPES


def read_reply(
    response: httpx.Response,
) -> tuple[int, dict[str, Any] | None, dict[str, Any], Answer | None]:
    """Status, parsed body and evidence of a response, and the shared 429/5xx answer if any."""
    status = response.status_code
    content = response.content
    body = _json_object(content)
    raw = None if body is not None else bounded_raw(content)
    evidence: dict[str, Any] = {"status_code": status, "body": body, "raw": raw}
    shared = answer_from_http_status(
        status, retry_after=response.headers.get("retry-after"), raw=content
    )
    return status, body, evidence, (replace(shared, body=body, raw=raw) if shared else None)
