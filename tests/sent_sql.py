"""The SQL a store sends, seen for real (tests of plans): every statement a PostgreSQL
store's cursors run, the hot ones on the driver connection included, and SQLite's through
SQLAlchemy's cursor event."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa

from payorch.storage._store import Store


@dataclass
class Sent:
    statement: str
    parameters: Any
    prepare: bool | None = None  # psycopg's: None after its threshold, False never


_recording: list[Sent] | None = None  # what PostgreSQL stores' cursors were asked to run


class RecordingCursor(psycopg.Cursor[Any]):
    """Sees every statement, the hot ones run on the driver connection included."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if _recording is not None:
            _recording.append(Sent(str(query), params, kwargs.get("prepare")))
        return super().execute(query, params, **kwargs)


def sent_by(store: Store, call: Callable[[Store], object]) -> list[Sent]:
    """Run ``call`` for real; the statements it sent, with their parameters."""
    global _recording
    seen: list[Sent] = []
    if store.is_postgres:
        _recording = seen
        try:
            call(store)
        finally:
            _recording = None
        return seen

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append(Sent(statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", record)
    try:
        call(store)
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", record)
    return seen


def one(sent: list[Sent], *needles: str) -> Sent:
    found = [s for s in sent if all(n in s.statement for n in needles)]
    assert len(found) == 1, [s.statement for s in sent]
    return found[0]
