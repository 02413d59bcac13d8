"""One submission's attempts: send, classify, retry inline what was certainly not sent
(same downstream key), record the answer fenced by version, and keep a late answer as
evidence. Shared by the executor and the reconciler's re-sends (``submit_and_record``).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core import State, backoff_delay
from ..errors import (
    ConfigurationError,
    InvalidRequest,
    ProviderIdempotencyError,
    StaleVersion,
)
from ..observing import _logs as logs
from ..observing import _metrics as metrics
from ..observing import _routing as routing_metrics
from ..observing import _tracing as tracing
from ..operations import Prepared
from ..outcome import decide, late_conflict
from ..provider import Answer, AnswerKind, Provider, SubmitRequest, WireRequest
from ..records import OperationRecord, Redactor
from ..routing import proves_not_sent
from ..storage import _route_keys as route_keys
from ..storage._bridge import pause
from ..storage._store import Store

if TYPE_CHECKING:
    from ..routing import Router
    from ._routes import Fallback

__all__ = ["RetryPolicy", "built_wire", "kept_for", "submit_and_record", "wire_of"]


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Inline retries for answers that were certainly not sent (same downstream key)."""

    max_attempts: int = 4
    base_delay: float = 0.1
    max_delay: float = 2.0
    first_check: timedelta = timedelta(seconds=2)  # first reconciler look at an unknown
    pending_check: timedelta = timedelta(seconds=5)

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ConfigurationError("retry policy: need max_attempts >= 1, 0 <= base <= max")


_CONFIGURATION_RETRY_AFTER = 60.0  # seconds
_LATE_RACES = 5  # attempts to fence a late conflict's flag before only recording it


def wire_of(prepared: Prepared, adapter: Provider) -> WireRequest | None:
    """What ``adapter`` will send for ``prepared`` (a ``WireRequest``), to keep with its claim:
    only where the adapter can say and the stored request hides nothing (a re-send must
    need nothing that was not stored). None otherwise, and for a request the adapter
    refuses: its ``submit`` gives that refusal after the claim, as ever."""
    if not callable(getattr(adapter, "wire_request", None)):
        return None
    if prepared.redactor is None and Redactor.redacted_at(prepared.new.request) is not None:
        return None  # the reconciler's own rule: what hides a value is never re-sent
    new = prepared.new
    request = SubmitRequest(
        tenant_id=new.tenant_id,
        operation=new.operation,
        operation_id="",  # not sent: the namespace's key and tags carry no per-claim id
        downstream_key=new.downstream_key,
        payload=prepared.payload,
        idempotency_key=new.idempotency_key,
        fingerprint=new.fingerprint,
    )
    return built_wire(adapter, request)


def built_wire(adapter: Provider, request: SubmitRequest) -> WireRequest | None:
    """What ``adapter`` will send for ``request`` (its ``wire_request``); None where it
    cannot say, or refuses the request (its ``submit`` then says so, classified)."""
    # A Resender (what isinstance(adapter, Resender) checks, without typing's walk of the
    # protocol on every call).
    wire_request = getattr(adapter, "wire_request", None)
    if not callable(wire_request):
        return None
    try:
        built = wire_request(request)
    except (ConfigurationError, InvalidRequest, UnicodeEncodeError):
        return None  # refused: submit says so after the claim, classified
    except Exception as exc:  # noqa: BLE001 - an adapter bug: sent as ever, never re-sent
        logs.executor_log.warning(
            "%s.wire_request failed (%s: %s): no request kept; its re-sends will escalate",
            adapter.name,
            type(exc).__name__,
            exc,
        )
        return None
    return built if isinstance(built, WireRequest) else None


def kept_for(wire: WireRequest | None, record: OperationRecord) -> bool:
    """Whether ``wire`` is a request of ``record``: sent under its downstream key (a wire
    built for another key, e.g. a take-over of a row claimed under an earlier key form or
    another key scope, would be another request under the provider's idempotency)."""
    return wire is not None and wire.idempotency_key in (None, record.downstream_key)


def _submit_once(adapter: Provider, request: SubmitRequest) -> tuple[Answer, bool]:
    """One attempt; returns the answer and whether it flags the operation for a human."""
    try:
        return adapter.submit(request), False
    except ProviderIdempotencyError as exc:
        # The provider holds a different request under our key: we cannot tell what it did
        # with this one. Unknown, and a human should look.
        return Answer(kind=AnswerKind.AMBIGUOUS, code="idempotency_error", message=str(exc)), True
    except ConfigurationError as exc:
        # The adapter refused before sending (e.g. an operation it does not support).
        # Flagged for the operator; a caller comes back with the same key once it is fixed,
        # not every few seconds.
        answer = Answer(
            kind=AnswerKind.NOT_SENT,
            code="configuration_error",
            message=str(exc),
            retry_after=_CONFIGURATION_RETRY_AFTER,
        )
        return answer, True
    except (UnicodeEncodeError, InvalidRequest) as exc:
        # The adapter could not turn the request into bytes, or refused it as invalid:
        # either way none of it reached the wire.
        code = "request_unencodable" if isinstance(exc, UnicodeEncodeError) else "invalid_request"
        return Answer(kind=AnswerKind.NOT_SENT, code=code, message=str(exc)), True
    except Exception as exc:  # noqa: BLE001 - an adapter bug must not escape unclassified
        # We cannot tell whether the request went out before it failed: possibly sent, so
        # the operation becomes unknown (the reconciler asks the provider) and is flagged.
        message = f"{type(exc).__name__}: {exc}"[:500]
        return Answer(kind=AnswerKind.AMBIGUOUS, code="adapter_error", message=message), True


def submit_and_record(
    store: Store,
    adapter: Provider,
    record: OperationRecord,
    payload: Mapping[str, Any],
    *,
    owner: str,
    lease: timedelta,
    retry: RetryPolicy,
    sleep: Callable[[float], None] = pause,  # awaits when run for the async API
    rand: Callable[[], float] = random.random,
    actor_kind: str = "provider_answer",
    not_sent_is_final: bool = True,
    redactor: Redactor | None = None,
    wire: WireRequest | None = None,
    router: Router | None = None,
    fallback: Fallback | None = None,
) -> OperationRecord:
    """Submit ``record`` (lease held by ``owner``, attempt marked possibly sent) and record
    the classified answer. Shared by the executor and the reconciler's re-submission.

    When no attempt got through, the operation is released (``in_progress``, leased by
    nobody, nothing possibly sent: :attr:`OperationRecord.released`) and no outcome is
    stored; the executor then raises ``ProviderUnavailable``. ``not_sent_is_final=False``
    (re-submission): it stays ``outcome_unknown`` for a later check instead, because an
    earlier attempt, outside this call, may still surface at the provider.

    ``payload`` is what goes to the provider, as it is: the caller's full request (the
    executor, its inline retries and its take-over of a released operation), or a stored
    request only once :meth:`Redactor.redacted_at <payorch.records.Redactor.redacted_at>`
    found no ``[redacted]`` in it (the reconciler's re-send; it escalates the others).
    ``redactor``: what the provider's echo must not store; None (default) derives it from
    ``record.request`` and ``payload`` (:meth:`Redactor.of <payorch.records.Redactor.of>`).
    ``wire``: the request the claim kept (a ``WireRequest``), which every send hands the
    adapter to send as it is (``SubmitRequest.wire``).

    A routed operation: every answer tells ``router`` how the provider fares (its health),
    and ``fallback`` (:mod:`payorch.execution._routes`), when given, is where it moves once
    an answer proves the attempt did not execute (not sent, a decline the router lists):
    the move (provider, downstream key, route; the next attempt possibly sent, the lease
    renewed) is recorded, and the record returned names the next provider.
    """
    request = SubmitRequest(
        tenant_id=record.tenant_id,
        operation=record.operation,
        operation_id=record.id,
        downstream_key=record.downstream_key,
        payload=payload,
        idempotency_key=record.idempotency_key,
        fingerprint=record.fingerprint,
        wire=wire,
    )
    # What the provider echoes of a sensitive value is stored nowhere (evidence, response);
    # by value where the stored request hid one, by name everywhere (payorch.records).
    if redactor is None:
        redactor = Redactor.of(record.request, payload)
    calls = metrics.for_provider(adapter.name)
    attempt = 1
    while True:
        started = time.monotonic()
        with tracing.attempt(adapter.name, request, attempt) as span:
            answer, attention = _submit_once(adapter, request)
            tracing.answered(span, answer)
        logs.answered(request, attempt, answer)
        answer = redactor.answer(answer)
        calls.answered("submit", answer.kind, time.monotonic() - started)
        if router is not None:
            router.health.observe(adapter.name, answer.kind)
        detail = {
            "attempt": attempt,
            "duration_ms": round((time.monotonic() - started) * 1000, 1),
            "downstream_key": record.downstream_key,
            **answer.evidence(),
        }
        # A routed operation with somewhere to go moves on at once instead, on proof.
        retryable = (
            answer.kind is AnswerKind.NOT_SENT
            and not attention
            and (fallback is None or not proves_not_sent(answer))
        )
        too_long = (answer.retry_after or 0) > retry.max_delay
        if retryable and attempt < retry.max_attempts and not too_long:
            delay = backoff_delay(
                attempt - 1,
                base=retry.base_delay,
                cap=retry.max_delay,
                rand=rand,
                floor=answer.retry_after or 0.0,
            )
            detail["retry_in_ms"] = round(delay * 1000, 1)
            logs.retrying(request, attempt, answer, delay)
            try:
                # Records this attempt and renews the lease; the next one is possibly sent.
                record = _record(
                    store,
                    record,
                    State.IN_PROGRESS,
                    kind="attempt",
                    actor=owner,
                    detail=detail,
                    lease=lease,
                    lease_owner=owner,
                    attempts_delta=1,
                )
            except StaleVersion:
                return _late(store, record, owner, detail, answer)
            calls.retried()
            sleep(delay)
            attempt += 1
            continue
        if (
            router is not None
            and answer.kind is AnswerKind.NOT_SENT
            and not proves_not_sent(answer)
        ):
            # "Your key is in use" to the last: something may be executing under it there.
            # A routed operation stays with that provider as possibly sent (its reconciler
            # asks), never released for a later request to move it on.
            answer = dataclasses.replace(answer, kind=AnswerKind.AMBIGUOUS)
        proof = fallback.proof(answer) if fallback is not None else None
        if fallback is not None and proof is not None:
            return _fall_back(
                store,
                record,
                owner=owner,
                lease=lease,
                provider=adapter.name,
                fallback=fallback,
                proof=proof,
                answer=answer,
                detail={**detail, "attention": attention},
            )
        decision = decide(
            answer,
            first_check=retry.first_check,
            pending_check=retry.pending_check,
            not_sent_is_final=not_sent_is_final,
        )
        values: dict[str, Any] = {
            "response": decision.response,
            "error_code": decision.error_code,
            "resolution": actor_kind if decision.state.terminal else None,
            "provider_reference": decision.provider_reference,
        }
        released = decision.state is State.IN_PROGRESS and not_sent_is_final
        if answer.kind is AnswerKind.NOT_SENT and not_sent_is_final:
            values["possibly_sent"] = False  # every attempt was refused before sending
        if attention:
            values["needs_attention"] = True
        try:
            done = _record(
                store,
                record,
                decision.state,
                kind="not_sent" if released else actor_kind,
                actor=owner,
                detail=detail,
                next_check_in=decision.next_check_in,
                first_answer=True,  # uneventful (terminal, right after the claim): on the row
                **values,
            )
        except StaleVersion:
            return _late(store, record, owner, detail, answer)
        if attention and not record.needs_attention:
            metrics.escalated("adapter")  # the adapter could not be trusted: flagged
        return done


def _fall_back(
    store: Store,
    record: OperationRecord,
    *,
    owner: str,
    lease: timedelta,
    provider: str,
    fallback: Fallback,
    proof: Any,
    answer: Answer,
    detail: dict[str, Any],
) -> OperationRecord:
    """Record the move to ``fallback.to``: the proof and the answer that gave it, the next
    provider's downstream key and the request it will be sent (as the claim keeps one),
    the next attempt possibly sent, the lease renewed, in one fenced write."""
    attention = bool(detail.pop("attention", False))
    detail.update(
        proof=proof.value,
        from_provider=provider,
        from_key=record.downstream_key,  # what the left provider's webhooks and reports name
        to_provider=fallback.to,
        to_key=fallback.key,
    )
    wire = fallback.wire() if fallback.wire is not None else None
    if wire is not None:
        detail["wire"] = dict(wire)
    values: dict[str, Any] = {}
    if attention and not record.needs_attention:
        values["needs_attention"] = True  # the adapter refused it unsent: someone should know
    try:
        moved = _record(
            store,
            record,
            State.IN_PROGRESS,
            kind="fallback",
            actor=owner,
            detail=detail,
            lease=lease,
            lease_owner=owner,
            possibly_sent=True,
            attempts_delta=1,
            provider=fallback.to,
            downstream_key=fallback.key,
            route=fallback.moved_route(proof, answer, record.provider_reference),
            moved_on=True,
            # The key it leaves behind: that provider's webhooks and reports name it.
            also=route_keys.remember(store, [(provider, record.downstream_key)]),
            **values,
        )
    except StaleVersion:
        detail.pop("wire", None)
        return _late(store, record, owner, detail, answer)
    routing_metrics.fell_back(provider, fallback.to, proof.value)
    if values:
        metrics.escalated("adapter")
    return moved


def _record(store: Store, record: OperationRecord, state: State, **values: Any) -> OperationRecord:
    """``store.transition`` under a ``payorch.record`` span, logged once written."""
    with tracing.record(record, state, values["kind"]):
        after = store.transition(record, state, **values)
    logs.transition(record, after, values["kind"], values.get("detail"))
    return after


def _late(
    store: Store,
    record: OperationRecord,
    owner: str,
    detail: Mapping[str, Any],
    answer: Answer,
) -> OperationRecord:
    """Our lease was lost: the answer is evidence, never a write over the new holder.

    If the operation was meanwhile settled otherwise (reconciler, operator, webhook), the
    answer is kept as conflicting evidence and the operation flagged, in one fenced write.
    """
    for _ in range(_LATE_RACES):
        current = store.get(record.tenant_id, record.id)
        reason = late_conflict(current.state, current.provider_reference, answer)
        logs.late_answer(current, answer, reason)
        if reason is None:
            store.append_event(current, kind="late_answer", actor=owner, detail=detail)
            return current
        conflict = {**detail, "late": True, "conflicts_with": current.state.value}
        conflict["conflict"] = reason
        try:
            flagged = store.flag_attention(
                current, kind="conflicting_evidence", actor=owner, detail=conflict
            )
        except StaleVersion:
            continue  # written meanwhile (e.g. flagged by someone else): judge it again
        logs.transition(current, flagged, "conflicting_evidence", conflict)
        if not current.needs_attention:
            metrics.escalated("conflict")
        return flagged
    # Still racing: keep the evidence even if the flag could not be fenced in.
    store.append_event(current, kind="late_answer", actor=owner, detail=conflict)
    return store.get(record.tenant_id, record.id)
