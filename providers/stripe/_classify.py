"""Pure classification of Stripe replies into payorch :class:`Answer` kinds.

No I/O here: the adapter turns an ``httpx.Response`` into a :class:`Reply` and these
functions decide what it means, so the mapping tables can be read (and tested) in one place.

Shapes follow Stripe's API reference: the error object
``{"error": {"type", "code", "decline_code", "message", "payment_intent"}}``, the PaymentIntent
and Refund objects and their ``status`` enums, and the ``Idempotent-Replayed`` and
``Stripe-Should-Retry`` response headers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ...clients import ProviderReply
from ...errors import ProviderIdempotencyError
from ...provider import Answer, AnswerKind, answer_from_http_status, bounded_raw, parse_retry_after

__all__ = [
    "AUTHORIZATION_RELEASED",
    "PAYMENT_CAPTURE",
    "PAYMENT_CREATE",
    "REFUND_CREATE",
    "REFUND_KINDS",
    "SUPPORTED_OPERATIONS",
    "Reply",
    "authorization_released",
    "decline_code",
    "failure_answer",
    "object_answer",
    "pick_answer",
]

PAYMENT_CREATE = "payment.create"
PAYMENT_CAPTURE = "payment.capture"
REFUND_CREATE = "refund.create"
SUPPORTED_OPERATIONS = frozenset({PAYMENT_CREATE, PAYMENT_CAPTURE, REFUND_CREATE})

_S, _D, _P = AnswerKind.SUCCEEDED, AnswerKind.DECLINED, AnswerKind.PENDING

# PaymentIntent.status as the outcome of payment.create. requires_capture is the authorisation
# that a manual-capture payment.create asked for, so it is that operation's success.
_PAYMENT_KINDS: Mapping[str, AnswerKind] = {
    "succeeded": _S,
    "requires_capture": _S,
    "processing": _P,
    "requires_action": _P,  # customer action (3-D Secure, redirect) outstanding
    "requires_confirmation": _P,
    "requires_payment_method": _D,
    "canceled": _D,
}
# PaymentIntent.status as the outcome of payment.capture. The capture itself is only done at
# succeeded; a canceled intent can no longer be captured.
_CAPTURE_KINDS: Mapping[str, AnswerKind] = {"succeeded": _S, "processing": _P, "canceled": _D}
# Statuses in which no capture has happened yet: a status query reports NOT_FOUND (the
# capture is unknown to Stripe), so the reconciler may re-submit it with the same key.
_CAPTURE_NOT_APPLIED = frozenset(
    {"requires_capture", "requires_payment_method", "requires_confirmation", "requires_action"}
)
# The lifecycle of a manual-capture payment.create's effect after it succeeded: the hold was
# released (canceled by the merchant, or by Stripe when it expired uncaptured).
AUTHORIZATION_RELEASED = "authorization_released"
REFUND_KINDS: Mapping[str, AnswerKind] = {
    "succeeded": _S,
    "pending": _P,
    "requires_action": _P,
    "failed": _D,
    "canceled": _D,
}

# Error codes for a request that did not run: lock contention on the object, and the
# pre-429 400 rate_limit. Retried inline with the same key, and "not sent" if they persist.
_NOT_EXECUTED_CODES = frozenset({"lock_timeout", "rate_limit"})
# Stripe-Should-Retry: true promises that retrying with the same key is safe, not that
# nothing happened: with 409 idempotency_key_in_use another request under our key is still
# executing and may move money. Such replies are AMBIGUOUS (the reconciler asks, after their
# Retry-After), never "not sent", so no failed_final can claim nothing was sent.
_IN_FLIGHT_CODES = frozenset({"idempotency_key_in_use"})
# Credentials refused before anything ran: a configuration fault (see answer_from_http_status).
_AUTH_TYPES = frozenset({"authentication_error", "permission_error"})
AUTH_FAILED = "provider_auth_failed"
# 4xx error types that mean Stripe refused the request before anything moved.
_REFUSAL_TYPES = frozenset({"card_error", "invalid_request_error"})

# Kinds ordered by how much they must win when several objects answer one operation: money
# that moved outranks everything, and anything unsettled outranks a refusal.
_PRECEDENCE = (
    AnswerKind.SUCCEEDED,
    AnswerKind.PENDING,
    AnswerKind.AMBIGUOUS,
    AnswerKind.NOT_SENT,
    AnswerKind.DECLINED,
    AnswerKind.NOT_FOUND,
)


@dataclass(frozen=True, kw_only=True)
class Reply(ProviderReply):
    """One HTTP reply from Stripe, its body parsed once."""

    @property
    def replayed(self) -> bool:
        return self.says("idempotent-replayed")

    @property
    def should_retry(self) -> bool:
        return self.says("stripe-should-retry")

    @property
    def error(self) -> Mapping[str, Any] | None:
        err = self.body.get("error") if self.body is not None else None
        return err if isinstance(err, dict) else None

    def note(self, message: str | None) -> str | None:
        """``message``, marked when Stripe replayed a stored answer for our key."""
        if not self.replayed:
            return message
        return f"{message} (Idempotent-Replayed)" if message else "Idempotent-Replayed"


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _clip(code: str | None) -> str | None:
    # Codes end up in a String(100) column; Stripe's are short, anything odd is cut.
    return code[:64] if code is not None else None


def _embedded_intent_id(err: Mapping[str, Any] | None) -> str | None:
    intent = err.get("payment_intent") if err is not None else None
    return _text(intent.get("id")) if isinstance(intent, dict) else None


def failure_answer(
    reply: Reply, *, query: bool, operation_id: str | None = None, downstream_key: str = ""
) -> Answer | None:
    """The answer for a reply that is not a 2xx; None for a 2xx (the caller reads the body).

    With ``query`` the request was a read: a refusal then says nothing about the operation,
    so only 404 ``resource_missing`` becomes NOT_FOUND and other 4xx are AMBIGUOUS.

    Raises ProviderIdempotencyError when Stripe says the key was used with other parameters.
    """
    err = reply.error
    shared = answer_from_http_status(reply.status, retry_after=reply.retry_after, raw=reply.content)
    if shared is not None:
        # 401/403, 429 and 5xx: the shared rule decides the kind; Stripe's body is evidence.
        stripe_code = _clip(_text(err.get("code")) if err else None)
        stripe_message = _text(err.get("message")) if err else None
        if shared.code == AUTH_FAILED:  # keep our code: Stripe's (api_key_expired…) is evidence
            said = f" (Stripe said: {stripe_message})" if stripe_message else ""
            stripe_code, stripe_message = None, f"{shared.message}{said}"
        return replace(
            shared,
            code=stripe_code or shared.code,
            message=reply.note(stripe_message),
            provider_reference=_embedded_intent_id(err),
            body=reply.body,
            raw=shared.raw if reply.body is None else None,
        )
    if 200 <= reply.status < 300:
        return None
    if err is None:
        # A non-2xx without Stripe's error object did not come from Stripe's API (a proxy, a
        # wrong base_url, a 3xx): it tells nothing about the operation.
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            status_code=reply.status,
            code=f"http_{reply.status}",
            message=reply.note("non-2xx reply without a Stripe error object"),
            body=reply.body,
            raw=None if reply.body is not None else bounded_raw(reply.content),
        )
    return _error_answer(
        reply, err, query=query, operation_id=operation_id, downstream_key=downstream_key
    )


def _error_answer(
    reply: Reply,
    err: Mapping[str, Any],
    *,
    query: bool,
    operation_id: str | None,
    downstream_key: str,
) -> Answer:
    etype = _text(err.get("type"))
    code = _text(err.get("code"))
    message = reply.note(_text(err.get("message")))

    def answer(kind: AnswerKind, code: str | None, retry_after: float | None = None) -> Answer:
        return Answer(
            kind=kind,
            provider_reference=_embedded_intent_id(err),
            status_code=reply.status,
            retry_after=retry_after,
            code=_clip(code or etype or f"http_{reply.status}"),
            message=message,
            body=reply.body,
        )

    retry_after = parse_retry_after(reply.retry_after)
    if code in _NOT_EXECUTED_CODES or etype == "rate_limit_error":
        # Not executed (lock contention, rate limit): Stripe saves no idempotent result for
        # these, so a retry with the same key runs afresh.
        return answer(AnswerKind.NOT_SENT, code, retry_after)
    if reply.status == 409 or code in _IN_FLIGHT_CODES or reply.should_retry:
        # Safe to retry with the same key, but our key may be acting elsewhere right now.
        return answer(AnswerKind.AMBIGUOUS, code, retry_after)
    if etype in _AUTH_TYPES:
        # Credentials refused (with a status other than 401/403): nothing ran.
        auth = answer(AnswerKind.NOT_SENT, AUTH_FAILED, 60.0)
        return replace(auth, message=f"Stripe refused our credentials: {message or etype}")
    if query:
        missing = reply.status == 404 and code == "resource_missing"
        return answer(AnswerKind.NOT_FOUND if missing else AnswerKind.AMBIGUOUS, code)
    if etype == "idempotency_error":
        raise ProviderIdempotencyError(
            f"Stripe refused Idempotency-Key {downstream_key!r}: it was already used with "
            f"different parameters (Stripe said: {message or 'no message'})",
            operation_id=operation_id,
        )
    if etype in _REFUSAL_TYPES:  # only a card_error carries a decline_code
        return answer(AnswerKind.DECLINED, _text(err.get("decline_code")) or code)
    # api_error (and any type Stripe may add) is no verdict on the operation.
    return answer(AnswerKind.AMBIGUOUS, code)


def decline_code(obj: Mapping[str, Any]) -> str:
    """The error code of a declined PaymentIntent or Refund, however the decline was learnt.

    The one source for the status query and the webhook, so that an operation settled by
    either stores the same ``error_code``: the issuer's ``decline_code`` (e.g.
    ``insufficient_funds``), else the error ``code`` (``card_declined``) of the last payment
    attempt, else a refund's ``failure_reason`` or the intent's ``cancellation_reason``, else
    its status.
    """
    last = obj.get("last_payment_error")
    found = None
    if isinstance(last, dict):
        found = _text(last.get("decline_code")) or _text(last.get("code"))
    found = found or _text(obj.get("failure_reason")) or _text(obj.get("cancellation_reason"))
    return _clip(found or _text(obj.get("status")) or "declined") or "declined"


def authorization_released(obj: Mapping[str, Any]) -> bool:
    """Whether a canceled PaymentIntent had been authorised (``requires_capture``) first.

    Stripe cancels an intent from ``requires_capture`` (refunding the held amount) as from the
    statuses before any authorisation, and the canceled object does not keep the status it
    left, so the evidence is indirect: only a manual-capture intent holds an authorisation,
    its latest charge is the authorised one when the last attempt did not fail (a failed
    attempt leaves ``last_payment_error`` and a failed charge), and an expanded charge says it
    itself (``succeeded``, not captured).
    """
    if obj.get("status") != "canceled" or obj.get("capture_method") != "manual":
        return False
    if obj.get("last_payment_error"):
        return False
    charge = obj.get("latest_charge")
    if isinstance(charge, dict):
        return charge.get("status") == "succeeded" and charge.get("captured") is not True
    return _text(charge) is not None


def object_answer(
    operation: str,
    obj: object,
    *,
    query: bool,
    status_code: int | None,
    tag: tuple[str, str] | None = None,
    reply: Reply | None = None,
) -> Answer:
    """Classify one PaymentIntent or Refund object as the outcome of ``operation``.

    With ``tag`` (a metadata key and the operation's value, ``forms.own_tag``) the object's
    metadata under that key, when set, must match (it is not checked for a capture: the
    intent carries its payment.create's tag).
    """
    expected = "refund" if operation == REFUND_CREATE else "payment_intent"
    fields = obj if isinstance(obj, dict) else {}
    ident = _text(fields.get("id"))
    status = _text(fields.get("status"))

    def note(message: str | None) -> str | None:
        return reply.note(message) if reply is not None else message

    body = fields or None
    raw = bounded_raw(reply.content) if reply is not None and body is None else None
    if ident is None or status is None or fields.get("object", expected) != expected:
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            status_code=status_code,
            code="unexpected_body",
            message=note(f"a 2xx reply that is not a {expected} with an id and a status"),
            body=body,
            raw=raw,
        )

    metadata = fields.get("metadata")
    tagged = metadata.get(tag[0]) if isinstance(metadata, dict) and tag is not None else None
    if tag is not None and operation != PAYMENT_CAPTURE and tagged not in (None, tag[1]):
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            provider_reference=ident,
            status_code=status_code,
            code="reference_mismatch",
            message=f"{ident} belongs to {tag[0]} {tagged!r}, not {tag[1]!r}",
            body=body,
        )

    released = operation == PAYMENT_CREATE and authorization_released(fields)
    if operation == REFUND_CREATE:
        kind = REFUND_KINDS.get(status)
    elif operation == PAYMENT_CAPTURE:
        kind = _CAPTURE_KINDS.get(status)
        if kind is None and query and status in _CAPTURE_NOT_APPLIED:
            kind = AnswerKind.NOT_FOUND
    elif released:
        # The authorisation payment.create asked for was granted, then released: that is what
        # became of the effect afterwards, not a decline of the operation.
        kind = AnswerKind.SUCCEEDED
    else:
        kind = _PAYMENT_KINDS.get(status)
    if kind is None:
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            provider_reference=ident,
            status_code=status_code,
            code=_clip(f"unexpected_status:{status}"),
            message=note(f"{expected} status {status!r} is no outcome of {operation}"),
            body=body,
        )
    return Answer(
        kind=kind,
        provider_reference=ident,
        status_code=status_code,
        code=decline_code(fields) if kind is AnswerKind.DECLINED else None,
        message=note(f"authorised, then released ({AUTHORIZATION_RELEASED})" if released else None),
        body=body,
    )


def pick_answer(answers: list[Answer]) -> Answer:
    """One answer for several (at least one) objects tagged with the same operation.

    More than one should not happen: it means a duplicate effect at Stripe.
    The one that moved money wins, then anything unsettled; the message names them all so an
    operator sees the duplicate.
    """
    if len(answers) == 1:
        return answers[0]
    best = min(answers, key=lambda a: _PRECEDENCE.index(a.kind))
    refs = ", ".join(f"{a.provider_reference}={a.kind.value}" for a in answers)
    return replace(best, message=f"{len(answers)} Stripe objects carry this operation id: {refs}")
