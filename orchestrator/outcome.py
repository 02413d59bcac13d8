"""What a caller gets back (an execution's :class:`Outcome`, a webhook delivery's
:class:`WebhookResult`), and how a provider answer becomes a stored outcome (pure)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .core import State
from .errors import WebhookRejected
from .provider import Answer, AnswerKind
from .records import OperationRecord

__all__ = [
    "REFUSED_BEFORE_SENDING",
    "Decision",
    "Outcome",
    "WebhookDelivery",
    "WebhookResult",
    "WebhookStatus",
    "contradicts",
    "decide",
    "final_state",
    "late_conflict",
    "settled",
]

# An adapter's refusal of the request itself, before sending (executor._submit_once): the
# same request can never be sent, so it is a final answer (422), not a transient one.
REFUSED_BEFORE_SENDING = frozenset({"request_unencodable", "invalid_request"})

# Stored outcomes carry the status an HTTP front end should replay.
_STATUS_FOR_STATE = {
    State.SUCCEEDED: 200,
    State.FAILED_FINAL: 402,
    State.OUTCOME_UNKNOWN: 202,
    State.IN_PROGRESS: 409,
}


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """The answer to ``execute()``: the operation as it stands, and whether it is a replay."""

    operation_id: str
    tenant_id: str
    operation: str
    state: State
    replayed: bool
    http_status: int
    provider_reference: str | None
    error_code: str | None
    response: Mapping[str, Any] | None
    needs_attention: bool
    # The provider the operation stands with: for a routed one, the provider that settled
    # it (or holds its current attempt); ``routed``: whether payorch.routing chose it.
    provider: str = ""
    routed: bool = False

    @classmethod
    def from_record(cls, record: OperationRecord, *, replayed: bool) -> Outcome:
        status = _STATUS_FOR_STATE[record.state]
        if record.response and isinstance(record.response.get("http_status"), int):
            status = int(record.response["http_status"])
        return cls(
            operation_id=record.id,
            tenant_id=record.tenant_id,
            operation=record.operation,
            state=record.state,
            replayed=replayed,
            http_status=status,
            provider_reference=record.provider_reference,
            error_code=record.error_code,
            response=record.response,
            needs_attention=record.needs_attention,
            provider=record.provider,
            routed=record.route is not None,
        )

    @property
    def succeeded(self) -> bool:
        return self.state is State.SUCCEEDED

    @property
    def unknown(self) -> bool:
        return self.state is State.OUTCOME_UNKNOWN


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Where an answer moves an operation, with the values to store."""

    state: State
    response: dict[str, Any] | None
    error_code: str | None
    provider_reference: str | None
    next_check_in: timedelta | None = None


def decide(
    answer: Answer,
    *,
    first_check: timedelta,
    pending_check: timedelta,
    not_sent_is_final: bool = True,
) -> Decision:
    """Map a classified answer to a state (NOT_SENT after the caller's retries).

    The response keeps the answer's body as given: callers pass an answer already
    redacted (:meth:`payorch.records.Redactor.answer`), as its evidence is.
    """
    ref = answer.provider_reference
    if answer.kind is AnswerKind.SUCCEEDED:
        return Decision(
            state=State.SUCCEEDED,
            response={
                "status": "succeeded",
                "http_status": 200,
                "provider_reference": ref,
                "provider_response": dict(answer.body) if answer.body else None,
            },
            error_code=None,
            provider_reference=ref,
        )
    if answer.kind is AnswerKind.DECLINED:
        return Decision(
            state=State.FAILED_FINAL,
            response={
                "status": "failed",
                "http_status": 402,
                "code": answer.code,
                "message": answer.message,
                "provider_reference": ref,
            },
            error_code=answer.code or "declined",
            provider_reference=ref,
        )
    refused = answer.kind is AnswerKind.NOT_SENT and answer.code in REFUSED_BEFORE_SENDING
    if refused and not_sent_is_final:
        # The adapter could not turn this very request into bytes: it never will, so the
        # key's answer is final, and what must change is the request (nothing was sent).
        # (A re-submission stays unknown instead: its first attempt may still surface.)
        return Decision(
            state=State.FAILED_FINAL,
            response={
                "status": "failed",
                "http_status": 422,
                "code": answer.code,
                "message": answer.message,
            },
            error_code=answer.code,
            provider_reference=ref,
        )
    if answer.kind is AnswerKind.NOT_SENT and not_sent_is_final:
        # Certain that nothing reached the provider: no outcome is stored (a transient
        # failure is not an answer to the key). The operation is released, in_progress and
        # leased by nobody, and the namespace's next request runs it again; the response
        # keeps what the caller is told meanwhile (when to come back, and why).
        return Decision(
            state=State.IN_PROGRESS,
            response={
                "status": "not_sent",
                "code": answer.code or "provider_unavailable",
                "retry_after": answer.retry_after,
            },
            error_code=answer.code or "provider_unavailable",
            provider_reference=ref,
        )
    delay = pending_check if answer.kind is AnswerKind.PENDING else first_check
    if answer.retry_after:
        delay = max(delay, timedelta(seconds=answer.retry_after))
    return Decision(
        state=State.OUTCOME_UNKNOWN,
        response=None,
        error_code=answer.code,
        provider_reference=ref,
        next_check_in=delay,
    )


def settled(answer: Answer) -> Decision | None:
    """The terminal decision a piece of evidence proves, or None if it proves none.

    Status queries and webhooks settle an operation only on a final answer; anything else
    (pending, not found, unavailable) leaves it to be checked again.
    """
    if answer.kind not in (AnswerKind.SUCCEEDED, AnswerKind.DECLINED):
        return None
    return decide(answer, first_check=timedelta(0), pending_check=timedelta(0))


_FINAL_STATE = {AnswerKind.SUCCEEDED: State.SUCCEEDED, AnswerKind.DECLINED: State.FAILED_FINAL}


def final_state(kind: AnswerKind) -> State | None:
    """The terminal state a final answer proves; None for anything inconclusive."""
    return _FINAL_STATE.get(kind)


def contradicts(state: State, kind: AnswerKind) -> bool:
    """Whether evidence of ``kind`` contradicts an operation that stands in ``state``.

    Only a final word for the *other* terminal state does. Pending, not found or
    inconclusive evidence contradicts nothing, and nothing contradicts a state that is not
    settled yet (the evidence may still settle it). Shared by webhooks and late answers.
    """
    target = _FINAL_STATE.get(kind)
    return state.terminal and target is not None and target is not state


def late_conflict(state: State, reference: str | None, answer: Answer) -> str | None:
    """Why a late ``answer`` conflicts with how its operation was settled, or None.

    Besides :func:`contradicts`, a final answer that names another provider object than
    the one the operation settled with conflicts too: under one downstream key that can only
    be a second effect.
    """
    if contradicts(state, answer.kind):
        return f"the provider said {answer.kind.value}; the operation is {state.value}"
    other = answer.provider_reference
    if final_state(answer.kind) is state and reference and other and other != reference:
        return f"the provider answered with {other}; the operation settled with {reference}"
    return None


# -- what a webhook's delivery came to ------------------------------------------------------


class WebhookStatus(enum.StrEnum):
    APPLIED = "applied"  # moved the operation
    RECORDED = "recorded"  # evidence kept, no state change (pending, or already that outcome)
    DUPLICATE = "duplicate"  # this event id was handled before
    CONFLICT = "conflict"  # contradicts a terminal state: flagged, never applied
    UNMATCHED = "unmatched"  # no such operation: stored for review
    IGNORED = "ignored"  # event type that does not move payments


@dataclass(frozen=True, kw_only=True)
class WebhookResult:
    """What :meth:`~payorch.WebhookHandler.handle` made of one delivery; the app answers
    ``http_status`` (200 unless payorch refused the event)."""

    status: WebhookStatus
    event_id: str
    operation_id: str | None = None
    state: State | None = None
    http_status: int = 200


@dataclass(frozen=True, kw_only=True)
class WebhookDelivery:
    """What :meth:`~payorch.WebhookHandler.handle_delivery` made of one delivery: a result
    per item taken, in order, and the items refused (position, error).

    A delivery with a refused item answers that error's status (400), so the provider sends
    it again: the items taken this time are then duplicates, and the refused one gets
    another chance. One that took every item answers 200 with the adapter's
    ``acknowledgement`` (e.g. ``[accepted]``), or payorch's JSON summary.
    """

    results: tuple[WebhookResult, ...]
    rejected: tuple[tuple[int, WebhookRejected], ...] = ()
    acknowledgement: str | None = None

    @property
    def http_status(self) -> int:
        return self.rejected[0][1].http_status if self.rejected else 200
