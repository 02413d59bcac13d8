"""Webhooks: verify, dedupe by event id in an inbox, find the operation, apply evidence.

One entry point for the embedding app: ``handle(tenant_id, provider, headers, body)``.
A bad signature raises (answer 400); everything else is a :class:`WebhookResult` the app
answers with 200, so providers stop re-sending what payorch has already taken.

The inbox row is inserted (``ON CONFLICT DO NOTHING``) in the same transaction as whatever
the event writes: two concurrent deliveries of one event cannot both take effect, and a
crash cannot apply an event without deduplicating it, or the reverse.

A verified event that could not be stored as it is (an id, type or reference longer than its
column, text the database cannot hold) is refused with :class:`WebhookUnstorable` (400)
before anything is read or written: storing it by a digest would dedupe it, but under an id
nobody can look up, and a 503 would make the provider re-send it for days.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core import State, is_namespace_key, operation_id_from_downstream_key, validate_tenant
from ..errors import (
    OperationNotFound,
    StaleVersion,
    UnknownProvider,
    WebhookRejected,
    WebhookUnstorable,
)
from ..observing import _logs as logs
from ..observing import _metrics as metrics
from ..observing import _routing as routing_metrics
from ..observing import _tracing as tracing
from ..outcome import WebhookDelivery, WebhookResult, WebhookStatus, contradicts, settled
from ..provider import Answer, AnswerKind, Provider, WebhookBatch, WebhookEvent, parse_deliveries
from ..records import OperationRecord, Redactor
from ..storage._engine import read_in_transaction, run_in_transaction
from ..storage._store import Store
from ..storage._tables import db_now, operations, webhook_inbox
from ._cross_flags import CROSS_DUPLICATE, cross_flag_open, duplicate_detail, names_late
from ._moved import LOOKBACK, moved_from
from ._voids import (
    RELEASED,
    VOID_REFUSED,
    VOID_REQUESTED,
    VOID_RESOLUTION,
    VOID_WANTED,
    VOIDED,
)

__all__ = ["WebhookHandler"]

_MAX_RACES = 5
_log = logs.webhooks_log


class _AlreadyHandled(Exception):
    """The inbox already holds this event id: roll the transaction back."""


_TARGET = {AnswerKind.SUCCEEDED: State.SUCCEEDED, AnswerKind.DECLINED: State.FAILED_FINAL}
_CODE = {State.SUCCEEDED: None, State.FAILED_FINAL: "declined"}
_MAX_CODE = 100  # payorch_operations.error_code


def _column_length(column: sa.Column[str]) -> int:
    length = getattr(column.type, "length", None)
    assert isinstance(length, int)
    return length


# What a verified event writes into fixed-width columns: (label, field, column width).
_LIMITS = (
    ("event id", "event_id", _column_length(webhook_inbox.c.event_id)),
    ("event type", "event_type", _column_length(webhook_inbox.c.event_type)),
    ("provider reference", "provider_reference", _column_length(operations.c.provider_reference)),
)


def _unstorable(text: str) -> str | None:
    """Why the database cannot hold ``text`` (PostgreSQL refuses NUL; UTF-8 lone surrogates)."""
    if "\x00" in text:
        return "contains a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    return None


def check_storable(event: WebhookEvent) -> None:
    """Refuse (400, nothing written) a verified event whose fields no column can hold."""
    for label, name, limit in _LIMITS:
        value = getattr(event, name)
        if value is None:
            continue
        if len(value) > limit:
            raise WebhookUnstorable(
                f"webhook {label} is {len(value)} characters long; at most {limit} are stored"
            )
        problem = _unstorable(value)
        if problem is not None:
            raise WebhookUnstorable(f"webhook {label} {problem}")


def _lookup_id(value: str | None) -> str | None:
    # An id taken from the event's metadata or key: one that no row can hold finds nothing
    # (and must not reach the database, which may refuse it outright).
    if value is None or len(value) > _column_length(operations.c.id) or _unstorable(value):
        return None
    return value


class WebhookHandler:
    def __init__(
        self, *, store: Store, providers: Iterable[Provider], actor: str = "webhook"
    ) -> None:
        self.store = store
        self.providers = {p.name: p for p in providers}
        self.actor = actor

    @metrics.counts_webhooks
    @tracing.instrumented_webhook
    def handle(
        self, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> WebhookResult:
        """Take a delivery of one event: its result, or the WebhookRejected it raised.

        A delivery of several events (an adapter with ``parse_webhooks``) is taken whole;
        the first refused item's error is raised once the others are applied, else the
        first item's result is returned. :meth:`handle_delivery` answers for every item.
        """
        delivery = self._deliver(
            tenant_id, provider, self._parse(tenant_id, provider, headers, body)
        )
        if delivery.rejected:
            raise delivery.rejected[0][1]
        return delivery.results[0]

    @tracing.instrumented_delivery
    def handle_delivery(
        self, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> WebhookDelivery:
        """Take every event of one delivery, each on its own through the inbox.

        One refused item (a bad signature, an unstorable field) never loses the others:
        they are applied, and the delivery's answer (:func:`~payorch.http.webhook_answer`)
        lets the provider send it again. A delivery that cannot be read at all raises
        WebhookRejected; storage trouble raises (503), and a re-sent delivery's items
        already taken are duplicates.
        """
        try:
            batch = self._parse(tenant_id, provider, headers, body)
        except Exception as exc:  # a delivery unread, or a provider not configured
            status = "rejected" if isinstance(exc, WebhookRejected) else "error"
            metrics.webhook_counted(provider if provider in self.providers else None, status)
            logs.webhook_refused(tenant_id, provider, exc)
            raise
        try:
            delivery = self._deliver(tenant_id, provider, batch)
        except Exception as exc:  # storage trouble: 503, and the provider sends it again
            metrics.webhook_counted(provider, "error")
            logs.webhook_refused(tenant_id, provider, exc)
            raise
        for result in delivery.results:
            metrics.webhook_counted(provider, result.status.value)
            logs.webhook(tenant_id, provider, result)
        for _, refused in delivery.rejected:
            metrics.webhook_counted(provider, "rejected")
            logs.webhook_refused(tenant_id, provider, refused)
        return delivery

    def _parse(
        self, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> WebhookBatch:
        validate_tenant(tenant_id)
        adapter = self.providers.get(provider)
        if adapter is None:
            raise UnknownProvider(f"no provider named {provider!r} is configured")
        return parse_deliveries(adapter, headers, body)  # raises WebhookRejected: nothing changed

    def _deliver(self, tenant_id: str, provider: str, batch: WebhookBatch) -> WebhookDelivery:
        results: list[WebhookResult] = []
        rejected: list[tuple[int, WebhookRejected]] = []
        for item in batch.items:
            if item.rejected is not None:
                rejected.append((item.index, item.rejected))
                continue
            assert item.event is not None
            try:
                results.append(self._take(tenant_id, provider, item.event))
            except WebhookRejected as exc:  # unstorable: this item only
                rejected.append((item.index, exc))
        return WebhookDelivery(
            results=tuple(results), rejected=tuple(rejected), acknowledgement=batch.acknowledgement
        )

    def _take(self, tenant_id: str, provider: str, event: WebhookEvent) -> WebhookResult:
        check_storable(event)  # before the first query: nothing read, nothing written
        duplicate = WebhookResult(status=WebhookStatus.DUPLICATE, event_id=event.event_id)
        if self._seen(tenant_id, provider, event.event_id):  # fast path; the insert decides
            return duplicate
        inbox = _Inbox(self.store, tenant_id, provider, event)
        try:
            record = self._find(tenant_id, provider, event)
            if record is None:
                return inbox.only(WebhookStatus.UNMATCHED, None)
            if event.outcome is None and event.lifecycle != VOID_REFUSED:
                return inbox.only(WebhookStatus.IGNORED, record)
            for _ in range(_MAX_RACES):
                try:
                    if record.provider != provider:  # an attempt the operation moved on from
                        return self._left_attempt(inbox, event, record, provider)
                    return self._apply(inbox, event, record)
                except StaleVersion:
                    record = self.store.get(tenant_id, record.id)
        except _AlreadyHandled:
            return duplicate
        raise StaleVersion(f"operation {record.id} kept changing", operation_id=record.id)

    # -- steps ------------------------------------------------------------------------

    def _seen(self, tenant_id: str, provider: str, event_id: str) -> bool:
        i = webhook_inbox.c
        query = sa.select(i.event_id).where(
            i.tenant_id == tenant_id, i.provider == provider, i.event_id == event_id
        )
        return read_in_transaction(
            self.store.engine, lambda conn: conn.execute(query).first() is not None
        )

    def _find(self, tenant_id: str, provider: str, event: WebhookEvent) -> OperationRecord | None:
        if event.downstream_key and is_namespace_key(event.downstream_key):
            # Our key names the namespace: the operation is the one that holds it.
            found = self.store.find_by_downstream_key(tenant_id, provider, event.downstream_key)
            if found is not None:
                return found
            # Or held it: an attempt at a provider a routed operation moved away from.
            since = self.store.db_time() - LOOKBACK
            key = event.downstream_key
            left = moved_from(self.store, provider, [key], since, tenant_id=tenant_id)
            if left.get(key):
                return left[key][0]
        op_id = _lookup_id(event.operation_id)
        if op_id is None and event.downstream_key:
            op_id = _lookup_id(operation_id_from_downstream_key(event.downstream_key))
        if op_id is not None:
            try:
                found = self.store.get(tenant_id, op_id)
            except OperationNotFound:
                found = None
            if found is not None and found.provider == provider:
                return found
        if event.provider_reference:
            return self.store.find_by_reference(tenant_id, provider, event.provider_reference)
        return None

    def _evidence(
        self, inbox: _Inbox, record: OperationRecord, detail: dict[str, Any]
    ) -> WebhookResult:
        """Keep the event as evidence; the operation does not change."""
        self.store.append_event(
            record,
            kind="webhook_evidence",
            actor=self.actor,
            detail=detail,
            also=inbox.claim(WebhookStatus.RECORDED),
        )
        return inbox.result(WebhookStatus.RECORDED, record)

    def _void_refused(
        self, inbox: _Inbox, record: OperationRecord, detail: dict[str, Any], *, voiding: bool
    ) -> WebhookResult:
        """The provider refused the void in flight: the operation stays unknown, flagged, and
        is never voided again by the policy (what it holds is a human's call)."""
        if not voiding:
            return self._evidence(inbox, record, detail)
        detail["decision"] = "the provider refused the void: escalate"
        updated = self.store.transition(
            record,
            State.OUTCOME_UNKNOWN,
            kind=VOID_REFUSED,
            actor=self.actor,
            detail=detail,
            resolution=VOID_REFUSED,
            needs_attention=True,
            also=inbox.claim(WebhookStatus.RECORDED),
        )
        logs.transition(record, updated, VOID_REFUSED, detail, logger=_log)
        if not record.needs_attention:
            metrics.escalated("evidence")
        return inbox.result(WebhookStatus.RECORDED, updated)

    def _flag(
        self, inbox: _Inbox, record: OperationRecord, detail: dict[str, Any], *, kind: str,
        reason: str = "conflict",
    ) -> WebhookResult:  # fmt: skip
        """Keep the evidence, change nothing else, call a human (a conflict, or ``reason``)."""
        flagged = self.store.flag_attention(
            record,
            kind=kind,
            actor=self.actor,
            detail=detail,
            also=inbox.claim(WebhookStatus.CONFLICT),
        )
        logs.transition(record, flagged, kind, detail, logger=_log)
        if not record.needs_attention:
            metrics.escalated(reason)
        return inbox.result(WebhookStatus.CONFLICT, record)

    def _left_attempt(
        self, inbox: _Inbox, event: WebhookEvent, record: OperationRecord, provider: str
    ) -> WebhookResult:
        """An event about an attempt ``record`` moved on from (at ``provider``): never its
        outcome. Money there is a cross-provider duplicate, flagged critical with both
        effects (the reconciler's policy reverses it on its next look); anything else is
        evidence about that attempt."""
        key = event.downstream_key or ""
        reference = event.provider_reference
        detail = {**_event_detail(event), "attempt_at": provider, "downstream_key": key}
        # A success of the attempt's own kind: a capture or a refund reported under its
        # key (an operator's refund of the duplicate, say) is evidence, not more money.
        money = (
            event.outcome is AnswerKind.SUCCEEDED
            and event.lifecycle is None
            and event.operation in (None, record.operation)
        )
        known = any(
            names_late(e, provider, key, reference)
            for e in self.store.events(record.tenant_id, record.id)
        )
        if not money or known:
            return self._evidence(inbox, record, detail)
        late = {
            "provider": provider,
            "downstream_key": key,
            "provider_reference": reference,
            "state": AnswerKind.SUCCEEDED.value,
            "evidence": {"webhook": detail},
        }
        flag = duplicate_detail(record, late, policy=None)
        if record.lease_owner is not None and not record.terminal:
            # An executor, the reconciler or a void is at work on it: the flag's event only,
            # so that write is not fenced out; the next look raises the flag from it.
            self.store.append_event(
                record, kind=CROSS_DUPLICATE, actor=self.actor, detail=flag,
                also=inbox.claim(WebhookStatus.CONFLICT),
            )  # fmt: skip
            logs.transition(record, record, CROSS_DUPLICATE, flag, logger=_log)
            result = inbox.result(WebhookStatus.CONFLICT, record)
        else:
            result = self._flag(inbox, record, flag, kind=CROSS_DUPLICATE, reason="cross_provider")
        routing_metrics.cross_provider_duplicate(provider)  # once written: counted once
        return result

    def _apply(self, inbox: _Inbox, event: WebhookEvent, record: OperationRecord) -> WebhookResult:
        detail = _event_detail(event)
        voiding = record.resolution == VOID_REQUESTED and not record.terminal
        # The hold released while a void of it was wanted (its confirmation, or a cancel that
        # raced it): the void's outcome, as a confirmed void settles it, never a success.
        released = (
            record.resolution in VOID_WANTED
            and not record.terminal
            and event.lifecycle in RELEASED
            and event.outcome in _TARGET
        )
        if event.operation is not None and event.operation != record.operation:
            # An event about another kind of operation found by this one's reference (a
            # refund made in the provider's dashboard, say): evidence, never its outcome.
            detail["reports_on"] = event.operation
            return self._evidence(inbox, record, detail)
        if event.lifecycle == VOID_REFUSED:
            return self._void_refused(inbox, record, detail, voiding=voiding)
        assert event.outcome is not None
        outcome, code = (AnswerKind.DECLINED, VOIDED) if released else (event.outcome, event.code)
        if released:
            detail["decision"] = "the authorisation was released while its void was wanted"
        target = _TARGET.get(outcome)
        if voiding and event.outcome is AnswerKind.SUCCEEDED and event.lifecycle is None:
            # A success while our void is in flight: the void's own evidence decides, and a
            # human must see that the two raced.
            detail["void_race"] = "a success arrived while the operation's void was in flight"
            return self._flag(inbox, record, detail, kind="void_race")
        if contradicts(record.state, outcome) and event.lifecycle is None:
            # A second, different final word: keep both, change nothing, call a human.
            detail["conflicts_with"] = record.state.value
            return self._flag(inbox, record, detail, kind="conflicting_evidence")
        if record.terminal or target is None:
            # Confirms the terminal state, or says "pending": evidence without a change.
            return self._evidence(inbox, record, detail)
        ref = event.provider_reference or record.provider_reference
        # The adapter's code, as its status query would store it for the same decline.
        code = (code or "")[:_MAX_CODE] or _CODE[target]
        decision = settled(Answer(kind=outcome, provider_reference=ref, code=code))
        assert decision is not None  # target is terminal, so the evidence is final
        updated = self.store.transition(
            record,
            target,
            kind="webhook",
            actor=self.actor,
            detail=detail,
            provider_reference=ref,
            response=decision.response,
            error_code=decision.error_code,
            # A void's notification settles what the void began; a race it lost stays flagged.
            resolution=VOID_RESOLUTION if released else "webhook",
            # Settled by evidence: nothing left for a human, unless a void raced it or a
            # cross-provider duplicate flagged it (that flag stays until acknowledged).
            needs_attention=(record.needs_attention if voiding else False)
            or cross_flag_open(self.store, record),
            also=inbox.claim(WebhookStatus.APPLIED),
        )
        logs.transition(record, updated, "webhook", detail, logger=_log)
        return inbox.result(WebhookStatus.APPLIED, updated)


def _event_detail(event: WebhookEvent) -> dict[str, Any]:
    """The event as evidence on its operation's log."""
    detail: dict[str, Any] = {
        "event_id": event.event_id,
        "event_type": event.event_type,
        "outcome": event.outcome.value if event.outcome is not None else None,
        "provider_reference": event.provider_reference,
    }
    if event.code is not None:
        detail["code"] = event.code
    if event.lifecycle is not None:
        # What became of the effect afterwards (e.g. a released authorisation).
        detail["lifecycle"] = event.lifecycle
    return detail


def _stored_body(event: WebhookEvent, record: OperationRecord | None) -> dict[str, Any] | None:
    """The event body as the inbox keeps it: what it echoes of the operation's sensitive
    fields redacted (an unmatched event has no request to redact by). An operation past
    retention keeps no bodies: its late deliveries are kept by id and type only."""
    if record is not None and record.reaped_at is not None:
        return None
    body = dict(event.body)
    return Redactor.of(record.request).json(body) if record is not None else body


class _Inbox:
    """The inbox row of one event, inserted inside the transaction that acts on it."""

    def __init__(self, store: Store, tenant_id: str, provider: str, event: WebhookEvent) -> None:
        self.store = store
        self.tenant_id = tenant_id
        self.provider = provider
        self.event = event

    def claim(self, status: WebhookStatus) -> Callable[[Connection, OperationRecord | None], None]:
        def insert(conn: Connection, record: OperationRecord | None) -> None:
            stmt = (
                self.store._insert(webhook_inbox)
                .values(
                    tenant_id=self.tenant_id,
                    provider=self.provider,
                    event_id=self.event.event_id,
                    event_type=self.event.event_type,
                    operation_id=record.id if record is not None else None,
                    result=status.value,
                    body=_stored_body(self.event, record),
                    received_at=db_now(),
                )
                .on_conflict_do_nothing()
                .returning(webhook_inbox.c.event_id)
            )
            if conn.execute(stmt).first() is None:
                raise _AlreadyHandled

        return insert

    def only(self, status: WebhookStatus, record: OperationRecord | None) -> WebhookResult:
        insert = self.claim(status)
        run_in_transaction(self.store.engine, lambda conn: insert(conn, record))
        return self.result(status, record)

    def result(self, status: WebhookStatus, record: OperationRecord | None) -> WebhookResult:
        return WebhookResult(
            status=status,
            event_id=self.event.event_id,
            operation_id=record.id if record is not None else None,
            state=record.state if record is not None else None,
        )
