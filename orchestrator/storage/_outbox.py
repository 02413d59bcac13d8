"""The outbox's writing side: what a message is, the hooks that stage messages when an
operation settles, and the rows they become (in the caller's transaction).

Public through :mod:`payorch.outbox` (``Message``, ``OutboxHooks``, ``stage``); the store
calls :meth:`OutboxHooks.rows` inside the transaction of every terminal transition, so a
settled operation and the messages it stages commit together or not at all.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pkgutil
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from ..core import MAX_JSON_INT, State, safe_text
from ..errors import ConfigurationError, InvalidMessage
from ..records import OperationRecord
from ._statements import new_id
from ._tables import OUTBOX_SEQUENCE, db_now, outbox

__all__ = [
    "DEFAULT_DESTINATION",
    "HOOK_FAILED",
    "Hook",
    "Message",
    "OutboxHooks",
    "checked_payload",
    "failed_row",
    "insert_rows",
    "load_hooks",
    "message_row",
    "resolve_path",
    "stable_id",
    "stage_settled",
    "staging",
]

_log = logging.getLogger("payorch.outbox")

DEFAULT_DESTINATION = "default"
# The type of the dead row a failing hook leaves in place of its messages (see rows()).
HOOK_FAILED = "payorch.hook_failed"
_ID_NAMESPACE = uuid.UUID("6f1c1d3e-4b8e-5a57-9a3e-7d2b0c5e9f41")  # payorch's hook messages
_LIMITS = {"type": 128, "aggregate_type": 128, "aggregate_id": 255, "destination": 64}


@dataclass(frozen=True, slots=True)
class Message:
    """One message to deliver at least once, in order with the others of its aggregate.

    ``type`` names what happened (``receipt.requested``); ``aggregate_type`` and
    ``aggregate_id`` name what it is about (``payment``, the operation id): messages of one
    aggregate are delivered in the order they were staged. ``payload`` is a JSON object.
    ``destination`` names the sink a relay sends it to. ``id`` is the stable message id
    (a UUIDv7 when not given): a receiver dedupes on it.
    """

    type: str
    aggregate_type: str
    aggregate_id: str
    payload: Mapping[str, Any]
    destination: str = DEFAULT_DESTINATION
    id: str | None = None


Hook = Callable[[OperationRecord], Iterable[Message]]


@dataclass
class OutboxHooks:
    """What each operation type stages when it settles: ``hooks.on("payment.create",
    "succeeded")(fn)``, where ``fn(operation)`` returns the messages (it runs inside the
    transaction of the terminal write: keep it pure, no I/O).

    A hook's name (``name=``, else ``module.qualname``) is part of its messages' ids, so it
    must be stable from process to process and unique per operation and state: a second
    hook under one name, or a callable with no qualified name (a ``functools.partial``, a
    callable object) and no ``name=``, is refused when registered."""

    _hooks: dict[tuple[str, State], list[tuple[str, Hook]]] = field(default_factory=dict)

    def on(
        self, operation: str, state: State | str, *, name: str | None = None
    ) -> Callable[[Hook], Hook]:
        target = State(state)
        if not target.terminal:
            raise ConfigurationError(
                f"outbox hooks run when an operation settles: {target.value} is not terminal"
            )

        def register(fn: Hook) -> Hook:
            hook_name = name or _hook_name(fn)
            listed = self._hooks.setdefault((operation, target), [])
            if any(known == hook_name for known, _ in listed):
                raise ConfigurationError(
                    f"two outbox hooks named {hook_name!r} for {operation} {target.value}: "
                    "give one a name= of its own (the name is part of its messages' ids)"
                )
            listed.append((hook_name, fn))
            return fn

        return register

    def wants(self, operation: str, state: State) -> bool:
        return (operation, state) in self._hooks

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def rows(self, record: OperationRecord) -> list[dict[str, Any]]:
        """The rows ``record``'s hooks stage. A hook that raises (or returns a message that
        cannot be stored) must not keep the outcome from being recorded: its messages are
        replaced by one dead-lettered :data:`HOOK_FAILED` row naming the error, visible to
        ``payorch outbox dead``, and an ERROR is logged."""
        rows: list[dict[str, Any]] = []
        for name, hook in self._hooks.get((record.operation, record.state), ()):
            try:
                made = [
                    message_row(record.tenant_id, m, record.id, stable=(record, name, i))
                    for i, m in enumerate(hook(record))
                ]
            except Exception as exc:  # noqa: BLE001 - any hook bug: the outcome still records
                made = [failed_row(record, name, exc)]
            rows.extend(made)
        return rows


def _hook_name(fn: Hook) -> str:
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        raise ConfigurationError(
            f"an outbox hook with no qualified name ({type(fn).__name__}) needs name=: the "
            "name is part of its messages' ids and must be the same in every process"
        )
    return f"{module}.{qualname}"


def failed_row(record: OperationRecord, hook: str, exc: BaseException) -> dict[str, Any]:
    """The dead :data:`HOOK_FAILED` row that stands for a hook's messages, logged at ERROR."""
    error = _clean(f"hook {hook} failed: {type(exc).__name__}: {safe_text(exc)}")[:2000]
    _log.error(
        "outbox hook failed for operation %s: %s",
        record.id,
        error,
        extra={"operation_id": record.id, "tenant_id": record.tenant_id},
    )
    failed = Message(
        type=HOOK_FAILED,
        aggregate_type="operation",
        aggregate_id=record.id,
        payload={
            "operation": record.operation,
            "state": record.state.value,
            "hook": _clean(hook)[:255],
            "error": error,
        },
    )
    dead = message_row(record.tenant_id, failed, record.id)
    dead.update(state="dead", last_error=error)
    return dead


def _clean(text: str) -> str:
    """Text any database can hold: no NUL, no lone surrogate."""
    return safe_text(text).replace("\x00", "\\x00")


def staging(hooks: OutboxHooks | None, operation: str, to_state: State) -> OutboxHooks | None:
    """``hooks`` if settling ``operation`` in ``to_state`` stages anything, else None (the
    store then keeps its one-statement write)."""
    if hooks is not None and to_state.terminal and hooks.wants(operation, to_state):
        return hooks
    return None


def stable_id(record: OperationRecord, hook: str, index: int) -> str:
    """The id of a hook's ``index``-th message for ``record``'s outcome: a UUID (v5) of the
    namespace-derived downstream key, the state and the hook. The same outcome recorded
    again (a failover lost the first record; the client's retry settled it anew) stages the
    same ids, so the receivers' dedupe still holds."""
    name = "\x1f".join((record.downstream_key, record.state.value, hook, str(index)))
    return str(uuid.uuid5(_ID_NAMESPACE, name))


def message_row(
    tenant_id: str,
    message: Message,
    operation_id: str | None,
    *,
    stable: tuple[OperationRecord, str, int] | None = None,
) -> dict[str, Any]:
    """The outbox row of ``message`` (pending, due now); ``InvalidMessage`` if it cannot be
    stored as it is. Nothing is written here. A message with no id gets a UUIDv7, or, from a
    hook (``stable``: the record, the hook's name, the index), :func:`stable_id`."""
    if not isinstance(message, Message):
        raise InvalidMessage(f"an outbox message must be a Message, not {type(message).__name__}")
    for name, limit in _LIMITS.items():
        _text(getattr(message, name), f"the message's {name}", limit)
    message_id = message.id
    if message_id is None:
        message_id = stable_id(*stable) if stable is not None else new_id()
    _text(message_id, "the message's id", 36)
    return {
        "tenant_id": tenant_id,
        "id": message_id,
        "aggregatetype": message.aggregate_type,
        "aggregateid": message.aggregate_id,
        "type": message.type,
        "payload": checked_payload(message.payload),
        "destination": message.destination,
        "operation_id": operation_id,
        "state": "pending",
        "attempts": 0,
        "last_error": None,
    }


def insert_rows(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert outbox rows in the caller's transaction, stamped by the database clock and
    numbered in the order given (``seq``: a sequence on PostgreSQL, the next rowid on
    SQLite, so one aggregate's messages keep the order they were staged in). An id already
    in the outbox stages nothing: that message exists."""
    if not rows:
        return
    postgres = conn.dialect.name == "postgresql"
    insert = postgresql.insert if postgres else sqlite.insert
    now = db_now()
    stmt = (
        insert(outbox)
        .values(next_attempt_at=now, created_at=now, updated_at=now, seq=_next_seq(postgres))
        .on_conflict_do_nothing(index_elements=["tenant_id", "id"])
    )
    conn.execute(stmt, rows)


def _next_seq(postgres: bool) -> Any:
    if postgres:
        return sa.text(f"nextval('{OUTBOX_SEQUENCE}')")
    # SQLite has one writer; the largest rowid is read from the b-tree's end, not scanned.
    return sa.text("(SELECT COALESCE(MAX(rowid), 0) + 1 FROM payorch_outbox)")


def stage_settled(conn: Connection, hooks: OutboxHooks, record: OperationRecord) -> None:
    """Stage what ``record``'s outcome stages, in the terminal write's transaction. Rows the
    database refuses after every check passed (a value it cannot hold) are replaced by the
    dead :data:`HOOK_FAILED` row, in a savepoint: the outcome is recorded whatever they
    held. Any other database error is the transaction's, as before."""
    rows = hooks.rows(record)
    if not rows:
        return
    try:
        with conn.begin_nested():
            insert_rows(conn, rows)
    except (sa.exc.DataError, sa.exc.StatementError) as exc:
        if isinstance(exc, sa.exc.DBAPIError) and not isinstance(exc, sa.exc.DataError):
            raise  # the connection's or the server's trouble, not the rows'
        insert_rows(conn, [failed_row(record, "(the rows it staged)", exc)])


def checked_payload(payload: Any) -> dict[str, Any]:
    """``payload`` as it will be stored and delivered (tuples become lists), or
    ``InvalidMessage`` naming the first part with no JSON form."""
    if not isinstance(payload, Mapping):
        kind = type(payload).__name__
        raise InvalidMessage(f"a message payload must be a JSON object, not {kind}")
    _walk(payload, "payload")
    stored: dict[str, Any] = json.loads(json.dumps(payload, ensure_ascii=False))
    return stored


def _walk(value: Any, path: str) -> None:  # noqa: PLR0912 - one branch per JSON kind
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        _utf8(value, path)
        if "\x00" in value:  # PostgreSQL's text cannot hold a NUL
            raise InvalidMessage(f"{path} holds a NUL character")
    elif isinstance(value, int):
        if abs(value) > MAX_JSON_INT:
            raise InvalidMessage(f"{path} is an integer beyond ±(2**53 - 1)")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidMessage(f"{path} is {value}, which JSON cannot carry")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidMessage(f"{path} has a key that is not a string: {k!r}")
            _utf8(k, f"{path} key")
            if "\x00" in k:
                raise InvalidMessage(f"{path} has a key with a NUL character")
            _walk(v, f"{path}.{safe_text(k)}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]")
    else:
        raise InvalidMessage(f"{path} is a {type(value).__name__}, which has no JSON form")


def _text(value: Any, what: str, limit: int) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidMessage(f"{what} must be a non-empty string")
    if len(value) > limit:
        raise InvalidMessage(f"{what} is longer than {limit} characters")
    _utf8(value, what)
    if "\x00" in value:  # PostgreSQL's text cannot hold a NUL
        raise InvalidMessage(f"{what} holds a NUL character")


def _utf8(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidMessage(f"{path} holds a lone surrogate (not valid UTF-8)") from None


def resolve_path(path: str, setting: str) -> Any:
    """The object at ``module:attribute`` (an application's, named by ``setting``);
    ``ConfigurationError`` in one line if it is not such a path or cannot be loaded."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"{setting}: {path!r} is not module:attribute")
    _look_here_too()
    try:
        return pkgutil.resolve_name(path)
    except Exception as exc:  # noqa: BLE001 - whatever the module raised: one line, not a trace
        reason = f"{type(exc).__name__}: {safe_text(exc)}"
        raise ConfigurationError(f"{setting}: cannot load {path!r}: {reason}") from None


def _look_here_too() -> None:
    """The app's modules are found from the directory the process runs in (as ``python -m``
    finds them), after everything else: a file there never shadows an installed module."""
    try:
        here = os.getcwd()
    except OSError:  # the directory was removed: nothing to add
        return
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def load_hooks(path: str) -> OutboxHooks:
    """The ``OutboxHooks`` at ``module:attribute`` (``PAYORCH_OUTBOX_HOOKS``)."""
    found = resolve_path(path, "PAYORCH_OUTBOX_HOOKS")
    if not isinstance(found, OutboxHooks):
        raise ConfigurationError(f"PAYORCH_OUTBOX_HOOKS: {path!r} is not an OutboxHooks")
    return found
