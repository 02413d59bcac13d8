"""``consumer(...)``: an inbound message (a webhook from anyone, a broker delivery, a job)
processed once in effect.

The namespace is the consumer's name, the key the message id, the fingerprint the payload:
a redelivery answers with the stored result, a delivery while one is in flight with
``OperationInProgress`` (or waits, bounded), the same id with another payload with
``IdempotencyKeyReused``. A message with no id cannot be processed once: ``InvalidMessage``,
before anything is written.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Generic, TypeVar, cast, overload

from ..errors import InvalidIdempotencyKey, InvalidMessage, InvalidTenant, UnencodableRequest
from ._functions import ExcTypes, key_text, tenant_of
from ._rules import payload_fingerprint
from ._run import StoreArg, async_store, check_store, run_async, run_sync, sync_store
from ._values import (
    DEFAULT_LEASE,
    DEFAULT_RETENTION,
    EffectResult,
    InboundMessage,
    Policy,
    Target,
    make_policy,
)

__all__ = ["AsyncConsumer", "Consumer", "consumer", "inbound"]

R = TypeVar("R")
_NO_PAYLOAD: Any = object()
TenantArg = str | Callable[[InboundMessage], object]


def _message_id(value: object) -> str:
    if value is None or value == "":
        raise InvalidMessage(
            "the message has no id: a consumer dedupes on the sender's message id, so a "
            "message without one cannot be processed once"
        )
    try:
        return key_text(value)
    except InvalidIdempotencyKey as exc:
        raise InvalidMessage(f"message id {value!r:.80}: {exc.message}") from None


def inbound(message: object, payload: Any = _NO_PAYLOAD) -> InboundMessage:
    """``message`` as an :class:`InboundMessage`: one already, a mapping with ``"id"`` (the
    whole mapping is the payload: a webhook body), an object with ``id`` and ``payload``
    (an outbox message), or an id given with its ``payload``."""
    if payload is not _NO_PAYLOAD:
        return InboundMessage(_message_id(message), payload)
    if isinstance(message, InboundMessage):
        return InboundMessage(_message_id(message.id), message.payload, message.metadata)
    if isinstance(message, Mapping):
        return InboundMessage(_message_id(message.get("id")), dict(message))
    if hasattr(message, "id") and hasattr(message, "payload"):
        metadata = getattr(message, "metadata", None)
        return InboundMessage(
            _message_id(message.id),
            message.payload,
            metadata if isinstance(metadata, Mapping) else {},
        )
    raise InvalidMessage(
        f"{type(message).__name__} is no message: pass an InboundMessage, a mapping with "
        "an 'id', an object with id and payload, or the id and the payload"
    )


class _Messages:
    def __init__(self, name: str, tenant: TenantArg) -> None:
        if isinstance(tenant, str):
            tenant_of(tenant)
        self.name, self.tenant = name, tenant

    def target(self, message: InboundMessage) -> Target:
        try:
            digest = payload_fingerprint(message.payload)
        except UnencodableRequest as exc:
            raise InvalidMessage(f"message {message.id!r}: {exc.message}") from None
        raw = self.tenant if isinstance(self.tenant, str) else self.tenant(message)
        try:
            tenant = tenant_of(raw)
        except InvalidTenant as exc:
            raise InvalidMessage(f"message {message.id!r}: {exc.message}") from None
        return Target(tenant_id=tenant, key=message.id, fingerprint=digest)


class Consumer(Generic[R]):
    """A handler of ``InboundMessage`` that processes each message id once in effect.

    Call it with a message (see :func:`inbound`); it returns the handler's stored result,
    on a redelivery too. :meth:`outcome` says whether the answer was replayed.
    """

    def __init__(
        self,
        handler: Callable[[InboundMessage], R],
        store: StoreArg,
        policy: Policy,
        messages: _Messages,
    ) -> None:
        functools.update_wrapper(self, handler)
        self._handler, self._store, self.policy, self._messages = handler, store, policy, messages

    def __call__(self, message: object, payload: Any = _NO_PAYLOAD, /) -> R:
        return cast("R", self.outcome(message, payload).value)

    def outcome(self, message: object, payload: Any = _NO_PAYLOAD, /) -> EffectResult:
        msg = inbound(message, payload)
        target = self._messages.target(msg)
        store = sync_store(self._store)
        return run_sync(store, self.policy, target, lambda: self._handler(msg))


class AsyncConsumer(Generic[R]):
    """:class:`Consumer` for a coroutine handler, on an ``AsyncStore``."""

    def __init__(
        self,
        handler: Callable[[InboundMessage], Awaitable[R]],
        store: StoreArg,
        policy: Policy,
        messages: _Messages,
    ) -> None:
        functools.update_wrapper(self, handler)
        self._handler, self._store, self.policy, self._messages = handler, store, policy, messages

    async def __call__(self, message: object, payload: Any = _NO_PAYLOAD, /) -> R:
        return cast("R", (await self.outcome(message, payload)).value)

    async def outcome(self, message: object, payload: Any = _NO_PAYLOAD, /) -> EffectResult:
        msg = inbound(message, payload)
        target = self._messages.target(msg)
        store = async_store(self._store)
        return await run_async(store, self.policy, target, lambda: self._handler(msg))


class _Decorator:
    def __init__(self, store: StoreArg, policy: Policy, messages: _Messages) -> None:
        check_store(store)
        self._store, self._policy, self._messages = store, policy, messages

    # A coroutine function matches both overloads: the first, narrower one applies.
    @overload
    def __call__(self, fn: Callable[[InboundMessage], Awaitable[R]]) -> AsyncConsumer[R]: ...  # type: ignore[overload-overlap]

    @overload
    def __call__(self, fn: Callable[[InboundMessage], R]) -> Consumer[R]: ...

    def __call__(self, fn: Callable[[InboundMessage], Any]) -> Any:
        if inspect.iscoroutinefunction(fn):
            check_store(self._store, asynchronous=True)
            return AsyncConsumer(fn, self._store, self._policy, self._messages)
        check_store(self._store, asynchronous=False)
        return Consumer(fn, self._store, self._policy, self._messages)


def consumer(
    store: StoreArg,
    *,
    name: str,
    tenant: TenantArg = "default",
    lease: timedelta = DEFAULT_LEASE,
    retention: timedelta = DEFAULT_RETENTION,
    retry_on: ExcTypes = (),
    final_on: ExcTypes = (),
    rerun_safe: bool = False,
    wait: timedelta | None = None,
    owner: str | None = None,
    key_scope: str | None = None,
) -> _Decorator:
    """Process each inbound message once in effect: ``@consumer(store, name="invoices")``
    over ``def handle(message: InboundMessage) -> JSON``.

    ``name`` is the namespace (the consumer's identity: renaming it forgets what it did).
    ``tenant``: a tenant id, or a function of the message. The rest is :func:`idempotent`'s:
    what the handler raises decides whether the message runs again (``retry_on``), is
    failed for good (``final_on``), or may have had its effect and is escalated (anything
    else; or run again when ``rerun_safe``).
    """
    policy = make_policy(
        namespace=name,
        lease=lease,
        retention=retention,
        retry_on=retry_on,
        final_on=final_on,
        rerun_safe=rerun_safe,
        wait=wait,
        owner=owner,
        key_scope=key_scope,
    )
    return _Decorator(store, policy, _Messages(name, tenant))
