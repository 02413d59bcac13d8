"""Pure classification of Adyen Checkout replies into payorch :class:`Answer` kinds.

No I/O here: the adapter turns an ``httpx.Response`` into a :class:`Reply` and these
functions decide what it means.

Shapes follow Adyen's Checkout API (v71): ``PaymentResponse`` with its ``resultCode`` enum,
the modification responses (HTTP 201, ``status: "received"``: the outcome arrives by
notification), and the ``ServiceError`` body ``{"status", "errorCode", "message",
"errorType", "pspReference"}``. Error code 704 ("request already processed or in progress")
comes as 409 or 422; with the ``Transient-Error: true`` header the same key may be sent again
later. Neither says the request was not processed: both are possibly sent (AMBIGUOUS).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ...clients import ProviderReply
from ...provider import Answer, AnswerKind, answer_from_http_status, bounded_raw, parse_retry_after

__all__ = [
    "IN_PROGRESS",
    "PAYMENT_CAPTURE",
    "PAYMENT_CREATE",
    "REFUND_CREATE",
    "RESULT_CODES",
    "SUPPORTED_OPERATIONS",
    "Reply",
    "failure_answer",
    "modification_answer",
    "payment_answer",
]

PAYMENT_CREATE = "payment.create"
PAYMENT_CAPTURE = "payment.capture"
REFUND_CREATE = "refund.create"
SUPPORTED_OPERATIONS = frozenset({PAYMENT_CREATE, PAYMENT_CAPTURE, REFUND_CREATE})

IN_PROGRESS = "704"  # "request already processed or in progress"

_S, _D, _P = AnswerKind.SUCCEEDED, AnswerKind.DECLINED, AnswerKind.PENDING

# PaymentResponse.resultCode as the outcome of payment.create. Authorised is the effect a
# payment.create asks for (with manual capture, the authorisation itself); Refused, Error and
# Cancelled are final. Everything else waits for the AUTHORISATION notification. Success and
# PartiallyAuthorised are left out on purpose: their meaning is not documented enough to be
# called an outcome (see _UNSETTLED below).
RESULT_CODES: Mapping[str, AnswerKind] = {
    "Authorised": _S,
    "Refused": _D,
    "Error": _D,
    "Cancelled": _D,
    "Received": _P,
    "Pending": _P,
    "PresentToShopper": _P,
    "RedirectShopper": _P,
    "IdentifyShopper": _P,
    "ChallengeShopper": _P,
    "AuthenticationFinished": _P,
    "AuthenticationNotRequired": _P,
}
# 4xx statuses of a request Adyen refused as it stands (validation, an impossible
# modification): nothing was done, and the same request would be refused again.
_REFUSED_STATUSES = frozenset({400, 422})


@dataclass(frozen=True, kw_only=True)
class Reply(ProviderReply):
    """One HTTP reply from Adyen, its body parsed once."""

    @property
    def transient(self) -> bool:
        """``Transient-Error: true``: the same key may be sent again later."""
        return self.says("transient-error")

    @property
    def error(self) -> Mapping[str, Any] | None:
        """The ``ServiceError`` body, when the body is one (it has an ``errorCode``)."""
        body = self.body
        if body is None or _text(body.get("errorCode")) is None:
            return None
        return body


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _clip(code: str | None) -> str | None:
    # Codes end up in a String(100) column; Adyen's are short, anything odd is cut.
    return code[:64] if code is not None else None


def _said(err: Mapping[str, Any] | None) -> str | None:
    if err is None:
        return None
    code, message = _text(err.get("errorCode")), _text(err.get("message"))
    if code and message:
        return f"{message} (Adyen error {code})"
    return message or (f"Adyen error {code}" if code else None)


def failure_answer(reply: Reply) -> Answer | None:
    """The answer for a reply that is not a 2xx; None for a 2xx (the caller reads the body).

    - ``Transient-Error: true`` (704 for a duplicate in flight, a 5xx, …): AMBIGUOUS with
      its Retry-After: the same key may be sent again, but the first request may be moving
      money (401/403/429 keep the shared NOT_SENT);
    - 704 without it: the key's first request was (or is being) processed: AMBIGUOUS;
    - 401/403, 429 and 5xx: the shared rule (:func:`answer_from_http_status`);
    - 400/422 with a ``ServiceError``: Adyen refused this request as it stands: DECLINED,
      with Adyen's ``errorCode`` as the code;
    - anything else (a 404, a reply without Adyen's error body): AMBIGUOUS.
    """
    if 200 <= reply.status < 300:
        return None
    err = reply.error
    code = _clip(_text(err.get("errorCode"))) if err is not None else None
    message = _said(err)
    reference = _text(err.get("pspReference")) if err is not None else None

    def answer(kind: AnswerKind, code: str | None, retry_after: float | None = None) -> Answer:
        return Answer(
            kind=kind,
            provider_reference=reference,
            status_code=reply.status,
            retry_after=retry_after,
            code=code or f"http_{reply.status}",
            message=message,
            body=reply.body,
            raw=bounded_raw(reply.content) if reply.body is None else None,
        )

    if reply.transient and reply.status not in _NOT_SENT_STATUSES:
        # "Retry with the same key": never "not processed". A 704 says the key's first
        # request is still being processed, a 5xx may follow a commit: possibly sent, and
        # the same key (a replay) answers it later.
        return answer(AnswerKind.AMBIGUOUS, code, parse_retry_after(reply.retry_after))
    shared = answer_from_http_status(reply.status, retry_after=reply.retry_after, raw=reply.content)
    if shared is not None and code != IN_PROGRESS:
        # The shared rule decides the kind and keeps its code; Adyen's words are evidence.
        said = f" (Adyen said: {message})" if message else ""
        return replace(
            shared,
            provider_reference=reference,
            message=f"{shared.message or shared.code}{said}",
            body=reply.body,
            raw=shared.raw if reply.body is None else None,
        )
    if err is None:
        # A non-2xx without Adyen's error body did not come from Adyen's API (a proxy, a
        # wrong base_url): it tells nothing about the operation.
        return replace(
            answer(AnswerKind.AMBIGUOUS, None), message="non-2xx reply without an Adyen error"
        )
    # 704 without Transient-Error: the key's first request was (or is being) processed.
    refused = reply.status in _REFUSED_STATUSES and code != IN_PROGRESS
    return answer(AnswerKind.DECLINED if refused else AnswerKind.AMBIGUOUS, code)


_NOT_SENT_STATUSES = frozenset({401, 403, 429})  # refused before anything was done


def _unexpected(reply: Reply, what: str) -> Answer:
    return Answer(
        kind=AnswerKind.AMBIGUOUS,
        status_code=reply.status,
        code="unexpected_body",
        message=f"a 2xx reply that is not {what}",
        body=reply.body,
        raw=bounded_raw(reply.content) if reply.body is None else None,
    )


def payment_answer(reply: Reply) -> Answer:
    """Classify the reply to ``POST /payments`` as the outcome of payment.create."""
    failure = failure_answer(reply)
    if failure is not None:
        return failure
    body = reply.body
    result = _text(body.get("resultCode")) if body is not None else None
    if body is None or result is None:
        return _unexpected(reply, "a PaymentResponse with a resultCode")
    reference = _text(body.get("pspReference"))
    kind = RESULT_CODES.get(result)
    if kind is None:
        # Success, PartiallyAuthorised, or a code Adyen adds later: no outcome we can name.
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            provider_reference=reference,
            status_code=reply.status,
            code=_clip(f"unexpected_result:{result}"),
            message=f"resultCode {result!r} is no outcome payorch can name",
            body=body,
        )
    code = None
    message = None
    if kind is AnswerKind.DECLINED:
        reason = _text(body.get("refusalReason"))
        code = _clip(reason or result.lower())
        message = f"{result}: {reason}" if reason else result
    return Answer(
        kind=kind,
        provider_reference=reference,
        status_code=reply.status,
        code=code,
        message=message,
        body=body,
    )


def modification_answer(reply: Reply, *, void: bool = False) -> Answer:
    """Classify the reply to a capture, refund or cancel request.

    A 201 with ``status: "received"`` is PENDING: Adyen took the request and reports its
    outcome in a notification (CAPTURE, REFUND, CANCELLATION, TECHNICAL_CANCEL). The
    reference is the modification's own ``pspReference``; for a void (evidence about the
    payment being voided) it is the payment's (``paymentPspReference``), when Adyen names it.
    """
    failure = failure_answer(reply)
    if failure is not None:
        return failure
    body = reply.body
    if body is None or body.get("status") != "received":
        return _unexpected(reply, 'a modification response with status "received"')
    own = _text(body.get("pspReference"))
    reference = _text(body.get("paymentPspReference")) if void else own
    return Answer(
        kind=AnswerKind.PENDING,
        provider_reference=reference,
        status_code=reply.status,
        message=f"received by Adyen as {own}; the outcome arrives by notification"
        if own
        else "received by Adyen; the outcome arrives by notification",
        body=body,
    )
