"""What one Stripe ``void`` does, as a flow of HTTP calls (see :mod:`._flows`), without I/O.

Only a ``payment.create`` can be voided: its PaymentIntent, while uncaptured, is canceled
(``POST /v1/payment_intents/{id}/cancel``, ``cancellation_reason=abandoned``) under the
void's own idempotency key (``VoidRequest.void_key``), so a void sent again after a crash is
the same void. The intent is found as a status query finds it (:func:`._flows.query_flow`:
by provider reference, else by Search on ``metadata['payorch_ref']``, else by listing), and
its fresh status decides:

===========================  ==================================================================
found                        answer
===========================  ==================================================================
nothing                      NOT_FOUND: Stripe holds nothing under the operation's key
``canceled``                 SUCCEEDED: void already (no call is made)
``succeeded``                DECLINED ``already_captured`` (no call is made)
any other status             the cancel's answer: ``canceled`` is SUCCEEDED; Stripe's refusal
                             (``payment_intent_unexpected_state``) is DECLINED with the
                             intent's status in the message, unless that status is
                             ``canceled`` (SUCCEEDED) or ``succeeded`` (``already_captured``)
===========================  ==================================================================

Transport failures, 429 and 5xx are classified as for any call (:func:`._classify.failure_answer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ...errors import ProviderIdempotencyError
from ...provider import Answer, AnswerKind, VoidRequest
from ._classify import PAYMENT_CREATE, Reply, failure_answer
from ._flows import Call, Flow, query_flow
from ._forms import STRIPE_ID

__all__ = ["ALREADY_CAPTURED", "CANCELLATION_REASON", "NOT_VOIDABLE", "cancel_call", "void_flow"]

NOT_VOIDABLE = "not_voidable"  # the operation made nothing a void can release
ALREADY_CAPTURED = "already_captured"  # the intent was captured: money moved, refund it
CANCELLATION_REASON = "abandoned"  # Stripe's reason for an intent payorch gave up on
# Kinds of a status query's answer that come from reading an intent's status.
_READ_KINDS = frozenset({AnswerKind.SUCCEEDED, AnswerKind.DECLINED, AnswerKind.PENDING})


def cancel_call(intent: str, void_key: str) -> Call:
    """The cancel of ``intent`` under ``void_key``."""
    return Call(
        method="POST",
        path=f"/v1/payment_intents/{intent}/cancel",
        form={"cancellation_reason": CANCELLATION_REASON},
        idempotency_key=void_key,
    )


def void_flow(request: VoidRequest, *, window: timedelta | None = None) -> Flow:
    """Void ``request``'s operation at Stripe (see the module docstring).

    ``window``: the endpoint's idempotency window, as for :func:`._flows.query_flow`.
    """
    if request.operation != PAYMENT_CREATE:
        return Answer(
            kind=AnswerKind.DECLINED,
            code=NOT_VOIDABLE,
            message=f"only payment.create can be voided at Stripe, not {request.operation}",
        )
    reference = request.provider_reference
    if reference is not None and not (
        reference.startswith("pi_") and STRIPE_ID.fullmatch(reference)
    ):
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            code="invalid_reference",
            message=f"stored provider reference {reference!r} is not a PaymentIntent id",
        )
    found = yield from query_flow(request, window=window)
    intent = _intent_of(found)
    if intent is None:
        # NOT_FOUND (nothing to release), or no readable intent: the lookup's answer as it is.
        return found
    ident, status = intent
    if status == "canceled":
        return _void(ident, found.body, message=f"{ident} is canceled already", found=found)
    if status == "succeeded":
        return _captured(ident, found.body, found=found)
    reply = yield cancel_call(ident, request.void_key)
    return replace(_cancel_answer(reply, ident, request), duplicates=found.duplicates)


def _intent_of(found: Answer) -> tuple[str, str] | None:
    """The id and status of the intent a status query read, if it read one."""
    body = found.body
    if found.kind not in _READ_KINDS or body is None or body.get("object") != "payment_intent":
        return None
    ident, status = body.get("id"), body.get("status")
    if not isinstance(ident, str) or not isinstance(status, str):
        return None
    return ident, status


def _void(
    ident: str,
    body: Mapping[str, Any] | None,
    *,
    message: str | None = None,
    status_code: int | None = None,
    found: Answer | None = None,
) -> Answer:
    return Answer(
        kind=AnswerKind.SUCCEEDED,
        provider_reference=ident,
        status_code=status_code,
        message=message,
        body=body,
        duplicates=found.duplicates if found is not None else (),
    )


def _captured(
    ident: str,
    body: Mapping[str, Any] | None,
    *,
    status_code: int | None = None,
    found: Answer | None = None,
) -> Answer:
    return Answer(
        kind=AnswerKind.DECLINED,
        provider_reference=ident,
        status_code=status_code,
        code=ALREADY_CAPTURED,
        message=f"{ident} has status succeeded: captured, so it can only be refunded",
        body=body,
        duplicates=found.duplicates if found is not None else (),
    )


def _cancel_answer(reply: Reply | Answer, ident: str, request: VoidRequest) -> Answer:
    """What Stripe's answer to the cancel of ``ident`` says about the void."""
    if isinstance(reply, Answer):
        return reply
    try:
        failure = failure_answer(
            reply, query=False, operation_id=request.operation_id, downstream_key=request.void_key
        )
    except ProviderIdempotencyError as exc:
        # The void key was used for another call: this void's effect is unknown, and no
        # verdict on the operation. An operator looks (sending it again answers the same).
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            provider_reference=ident,
            status_code=reply.status,
            code="idempotency_error",
            message=str(exc),
            body=reply.body,
        )
    if failure is None:
        return _canceled(reply, ident)
    if failure.kind is not AnswerKind.DECLINED:
        return failure  # not sent, or possibly acting: as for any call
    return _refusal(reply, failure, ident)


def _refusal(reply: Reply, failure: Answer, ident: str) -> Answer:
    """Stripe refused the cancel (a 4xx ``failure``): why, and what the intent is now."""
    err = reply.error or {}
    if reply.status == 404 and err.get("code") == "resource_missing":
        return replace(failure, kind=AnswerKind.NOT_FOUND, provider_reference=None)
    embedded = err.get("payment_intent")
    status = embedded.get("status") if isinstance(embedded, dict) else None
    if status == "canceled":
        return _void(ident, reply.body, message=failure.message, status_code=reply.status)
    if status == "succeeded":
        return _captured(ident, reply.body, status_code=reply.status)
    said = failure.message or "no message"
    state = f"{ident} has status {status}: " if isinstance(status, str) else ""
    return replace(failure, provider_reference=ident, message=f"{state}{said}")


def _canceled(reply: Reply, ident: str) -> Answer:
    body = reply.body
    status = body.get("status") if body is not None else None
    if body is not None and body.get("object") == "payment_intent" and status == "canceled":
        return _void(ident, body, message=reply.note(None), status_code=reply.status)
    return Answer(
        kind=AnswerKind.AMBIGUOUS,
        provider_reference=ident,
        status_code=reply.status,
        code="unexpected_body",
        message=reply.note(f"a 2xx cancel reply that is not a canceled intent (status {status!r})"),
        body=body,
    )
