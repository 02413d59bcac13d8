"""Webhooks: verify, dedupe by event id in an inbox, find the operation, apply evidence.

One entry point for the embedding app: ``handle(tenant_id, provider, headers, body)``.
A bad signature raises (answer 400); everything else is a :class:`WebhookResult` the app
answers with 200, so providers stop re-sending what payorch has already taken.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .core import State, operation_id_from_downstream_key, validate_tenant
from .errors import OperationNotFound, StaleVersion, UnknownProvider
from .provider import AnswerKind, Provider, WebhookEvent
from .records import OperationRecord
from .store import Store
from .tables import db_now, webhook_inbox

__all__ = ["WebhookHandler", "WebhookResult", "WebhookStatus"]

_MAX_RACES = 5


class WebhookStatus(enum.StrEnum):
    APPLIED = "applied"  # moved the operation
    RECORDED = "recorded"  # evidence kept, no state change (pending, or already that outcome)
    DUPLICATE = "duplicate"  # this event id was handled before
    CONFLICT = "conflict"  # contradicts a terminal state: flagged, never applied
    UNMATCHED = "unmatched"  # no such operation: stored for review
    IGNORED = "ignored"  # event type that does not move payments


@dataclass(frozen=True, kw_only=True)
class WebhookResult:
    status: WebhookStatus
    event_id: str
    operation_id: str | None = None
    state: State | None = None
    http_status: int = 200


_TARGET = {AnswerKind.SUCCEEDED: State.SUCCEEDED, AnswerKind.DECLINED: State.FAILED_FINAL}


class WebhookHandler:
    def __init__(self, *, store: Store, providers: Iterable[Provider], actor: str = "webhook"):
        self.store = store
        self.providers = {p.name: p for p in providers}
        self.actor = actor

    def handle(
        self, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> WebhookResult:
        validate_tenant(tenant_id)
        adapter = self.providers.get(provider)
        if adapter is None:
            raise UnknownProvider(f"no provider named {provider!r} is configured")
        event = adapter.parse_webhook(headers, body)  # raises WebhookRejected: nothing changed
        if self._seen(tenant_id, provider, event.event_id):
            return WebhookResult(status=WebhookStatus.DUPLICATE, event_id=event.event_id)
        record = self._find(tenant_id, provider, event)
        if record is None:
            return self._inbox_only(tenant_id, provider, event, WebhookStatus.UNMATCHED, None)
        if event.outcome is None:
            return self._inbox_only(tenant_id, provider, event, WebhookStatus.IGNORED, record)
        for _ in range(_MAX_RACES):
            try:
                return self._apply(tenant_id, provider, event, record)
            except StaleVersion:
                record = self.store.get(tenant_id, record.id)
        raise StaleVersion(f"operation {record.id} kept changing", operation_id=record.id)

    # -- steps ------------------------------------------------------------------------

    def _seen(self, tenant_id: str, provider: str, event_id: str) -> bool:
        with self.store.engine.connect() as conn:
            found = conn.execute(
                sa.select(webhook_inbox.c.event_id).where(
                    webhook_inbox.c.tenant_id == tenant_id,
                    webhook_inbox.c.provider == provider,
                    webhook_inbox.c.event_id == event_id,
                )
            ).first()
        return found is not None

    def _find(self, tenant_id: str, provider: str, event: WebhookEvent) -> OperationRecord | None:
        op_id = event.operation_id
        if op_id is None and event.downstream_key:
            op_id = operation_id_from_downstream_key(event.downstream_key)
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

    def _apply(
        self, tenant_id: str, provider: str, event: WebhookEvent, record: OperationRecord
    ) -> WebhookResult:
        assert event.outcome is not None
        detail = {
            "event_id": event.event_id,
            "event_type": event.event_type,
            "outcome": event.outcome.value,
            "provider_reference": event.provider_reference,
        }
        target = _TARGET.get(event.outcome)
        if record.terminal:
            if target is None or target is record.state:
                return self._evidence(tenant_id, provider, event, record, detail)
            # A second, different final word: keep both, change nothing, call a human.
            detail["conflicts_with"] = record.state.value
            flagged = self.store.flag_attention(
                record, kind="conflicting_evidence", actor=self.actor, detail=detail
            )
            self._record_inbox(tenant_id, provider, event, WebhookStatus.CONFLICT, flagged.id)
            return WebhookResult(
                status=WebhookStatus.CONFLICT,
                event_id=event.event_id,
                operation_id=record.id,
                state=record.state,
            )
        if target is None:  # pending: evidence, and the reference if we lacked it
            return self._evidence(tenant_id, provider, event, record, detail)

        def inbox(conn: Connection, updated: OperationRecord) -> None:
            self._insert_inbox(
                conn,
                tenant_id,
                provider=provider,
                event=event,
                status=WebhookStatus.APPLIED,
                operation_id=updated.id,
            )

        ref = event.provider_reference or record.provider_reference
        response: dict[str, Any] = (
            {"status": "succeeded", "http_status": 200, "provider_reference": ref}
            if target is State.SUCCEEDED
            else {
                "status": "failed",
                "http_status": 402,
                "code": "declined",
                "provider_reference": ref,
            }
        )
        updated = self.store.transition(
            record,
            target,
            kind="webhook",
            actor=self.actor,
            detail=detail,
            provider_reference=ref,
            response=response,
            error_code=None if target is State.SUCCEEDED else "declined",
            resolution="webhook",
            also=inbox,
        )
        return WebhookResult(
            status=WebhookStatus.APPLIED,
            event_id=event.event_id,
            operation_id=updated.id,
            state=updated.state,
        )

    def _evidence(
        self,
        tenant_id: str,
        provider: str,
        event: WebhookEvent,
        record: OperationRecord,
        detail: Mapping[str, Any],
    ) -> WebhookResult:
        self.store.append_event(record, kind="webhook_evidence", actor=self.actor, detail=detail)
        self._record_inbox(tenant_id, provider, event, WebhookStatus.RECORDED, record.id)
        return WebhookResult(
            status=WebhookStatus.RECORDED,
            event_id=event.event_id,
            operation_id=record.id,
            state=record.state,
        )

    def _inbox_only(
        self,
        tenant_id: str,
        provider: str,
        event: WebhookEvent,
        status: WebhookStatus,
        record: OperationRecord | None,
    ) -> WebhookResult:
        self._record_inbox(tenant_id, provider, event, status, record.id if record else None)
        return WebhookResult(
            status=status,
            event_id=event.event_id,
            operation_id=record.id if record else None,
            state=record.state if record else None,
        )

    def _record_inbox(
        self,
        tenant_id: str,
        provider: str,
        event: WebhookEvent,
        status: WebhookStatus,
        operation_id: str | None,
    ) -> None:
        with self.store.engine.begin() as conn:
            self._insert_inbox(
                conn,
                tenant_id,
                provider=provider,
                event=event,
                status=status,
                operation_id=operation_id,
            )

    def _insert_inbox(
        self,
        conn: Connection,
        tenant_id: str,
        *,
        provider: str,
        event: WebhookEvent,
        status: WebhookStatus,
        operation_id: str | None,
    ) -> None:
        stmt = self.store._insert(webhook_inbox).values(
            tenant_id=tenant_id,
            provider=provider,
            event_id=event.event_id,
            event_type=event.event_type,
            operation_id=operation_id,
            result=status.value,
            body=dict(event.body),
            received_at=db_now(),
        )
        conn.execute(stmt.on_conflict_do_nothing())
