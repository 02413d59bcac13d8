"""The transactional outbox: what happens after the payment, at least once and in order.

A message is staged in the same transaction as what caused it: an operation's terminal
outcome (:class:`OutboxHooks`, per operation type and state, given to the store), or the
application's own writes (:func:`stage` on its SQLAlchemy connection or session). A
:class:`Relay` delivers the staged messages to :class:`Sink` s by destination: at least
once, in order per aggregate and destination, with backoff, dead-lettered after
``max_attempts``; several relays share the work. Receivers dedupe on the message id.

See ``docs/outbox.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ..storage._outbox import HOOK_FAILED, Message, OutboxHooks, load_hooks
from . import _queue
from ._queue import StoredMessage
from ._relay import Relay, RelayPolicy, RelayReport
from ._sinks import OutboxMessage, Sink
from ._staging import astage, load_sinks, stage
from ._webhooks import WebhookEndpoint, WebhookSink, verify_webhook

__all__ = [
    "HOOK_FAILED",
    "Message",
    "OutboxHooks",
    "OutboxMessage",
    "Relay",
    "RelayPolicy",
    "RelayReport",
    "Sink",
    "StoredMessage",
    "WebhookEndpoint",
    "WebhookSink",
    "astage",
    "find",
    "load_hooks",
    "load_sinks",
    "messages",
    "purge",
    "retry",
    "stage",
    "stats",
    "verify_webhook",
]


def _engine(store: Any) -> Any:
    return getattr(store, "engine", store)


def messages(
    store: Any, *, state: str | None = None, tenant_id: str | None = None, limit: int = 50
) -> list[StoredMessage]:
    """Messages newest first (``state``: pending, delivered or dead)."""
    return _queue.listing(_engine(store), state=state, tenant_id=tenant_id, limit=limit)


def find(store: Any, message_id: str, *, tenant_id: str | None = None) -> StoredMessage:
    """One message by id (``MessageNotFound`` if none)."""
    return _queue.find(_engine(store), message_id, tenant_id=tenant_id)


def retry(
    store: Any, message_id: str, *, actor: str, reason: str, tenant_id: str | None = None
) -> StoredMessage:
    """Make a dead (or backing-off) message due now with a fresh count of attempts, audited
    (an ``outbox_retry`` event with ``actor`` and ``reason``)."""
    return _queue.retry(_engine(store), message_id, actor=actor, reason=reason, tenant_id=tenant_id)


def purge(store: Any, *, older_than: timedelta, dry_run: bool = False) -> int:
    """Delete the messages delivered more than ``older_than`` ago; how many (would be)."""
    return _queue.purge(_engine(store), older_than=older_than, dry_run=dry_run)


def stats(store: Any, *, tenant_id: str | None = None) -> Mapping[str, Any]:
    """Counts by state, how many are due now, and the oldest pending message's age."""
    return _queue.stats(_engine(store), tenant_id=tenant_id)
