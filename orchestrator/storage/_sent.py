"""The request an operation's adapter sent, as its claim kept it (a ``WireRequest``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..provider import WireRequest
from ..records import OperationRecord
from ._engine import read_in_transaction
from ._tables import events, operations

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = ["sent_wire"]

# The events whose detail carries what the next send is: the claim, the take-over of a
# released operation (which stores the request it runs with), and a routed operation's move
# to its next provider (the request that provider is sent).
_CLAIM_KINDS = ("claimed", "reclaimed", "fallback")


def sent_wire(engine: Engine, record: OperationRecord) -> WireRequest | None:
    """The wire request of ``record``'s latest claim or take-over; None if it kept none (an
    adapter that cannot say, a request that hid a sensitive value, a reaped operation) or
    kept one under another key than the operation's."""
    e = events.c
    query = (
        sa.select(e.detail)
        .where(
            e.tenant_id == record.tenant_id,
            e.operation_id == record.id,
            e.kind.in_(_CLAIM_KINDS),
        )
        .order_by(e.version.desc())
        .limit(1)
    )

    def read(conn: Connection) -> object:
        found = conn.execute(query).scalar()
        if found is not None:
            return found
        # The claim's own event is kept on the row (see _folded.py): its detail is there.
        o = operations.c
        kept = conn.execute(
            sa.select(o.claim_event).where(o.tenant_id == record.tenant_id, o.id == record.id)
        ).scalar()
        return kept.get("detail") if isinstance(kept, dict) else None

    detail = read_in_transaction(engine, read)
    wire = WireRequest.from_stored(detail.get("wire")) if isinstance(detail, dict) else None
    if wire is not None and wire.idempotency_key not in (None, record.downstream_key):
        return None  # built for another key (a take-over of an earlier key form): not this
    return wire
