"""Staging messages in the application's own transaction (same database as payorch's).

``stage(connection, messages)`` inserts on the caller's SQLAlchemy ``Connection`` or ORM
``Session``: the messages commit or roll back with the caller's own writes. Every message is
checked first, so a refused one (``InvalidMessage``) leaves nothing written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy.engine import Connection

from ..core import validate_tenant
from ..errors import ConfigurationError, InvalidMessage
from ..storage._outbox import Message, insert_rows, message_row, resolve_path
from ._sinks import Sink

__all__ = ["astage", "load_sinks", "stage"]


def _rows(messages: Message | Iterable[Message], tenant_id: str) -> list[dict[str, Any]]:
    tenant = validate_tenant(tenant_id)
    batch = [messages] if isinstance(messages, Message) else list(messages)
    if not batch:
        raise InvalidMessage("nothing to stage: no messages")
    rows = [message_row(tenant, m, None) for m in batch]
    ids = [row["id"] for row in rows]
    if len(set(ids)) != len(ids):
        raise InvalidMessage("two of the messages share an id")
    return rows


def stage(
    connection: Any, messages: Message | Iterable[Message], *, tenant_id: str = "default"
) -> list[str]:
    """Insert ``messages`` in the transaction of ``connection`` (a ``Connection`` or a
    ``Session``); their ids, in order. Nothing is committed here."""
    rows = _rows(messages, tenant_id)
    conn = connection
    if not isinstance(connection, Connection) and callable(getattr(connection, "connection", None)):
        conn = connection.connection()  # an ORM Session: its connection, in its transaction
    if not isinstance(conn, Connection):
        raise InvalidMessage(
            f"stage() needs a SQLAlchemy Connection or Session, not {type(connection).__name__}"
        )
    insert_rows(conn, rows)
    return [row["id"] for row in rows]


async def astage(
    connection: Any, messages: Message | Iterable[Message], *, tenant_id: str = "default"
) -> list[str]:
    """:func:`stage` on an ``AsyncConnection`` or ``AsyncSession``."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    rows = _rows(messages, tenant_id)
    conn = await connection.connection() if isinstance(connection, AsyncSession) else connection
    if not isinstance(conn, AsyncConnection):
        kind = type(connection).__name__
        raise InvalidMessage(f"astage() needs an AsyncConnection or AsyncSession, not {kind}")
    await conn.run_sync(lambda sync: insert_rows(sync, rows))
    return [row["id"] for row in rows]


def load_sinks(path: str) -> Mapping[str, Sink]:
    """The sinks at ``module:attribute`` (``PAYORCH_OUTBOX_SINKS``): a mapping of destination
    names to sinks, or a callable returning one (called once)."""
    found = resolve_path(path, "PAYORCH_OUTBOX_SINKS")
    if callable(found) and not isinstance(found, Mapping):
        found = found()
    if not isinstance(found, Mapping) or not found:
        raise ConfigurationError(
            f"PAYORCH_OUTBOX_SINKS: {path!r} is not a mapping of destination names to sinks"
        )
    return found
