"""``idempotent(...)``: any function whose effect is not a provider call, run once per key.

The decorator inspects the callable (a coroutine function gets the async form) and
derives each call's key, tenant and fingerprint from its arguments before anything is
written: bad input is refused with nothing stored, and a call's arguments never reach the
database except as their fingerprint.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Generic, ParamSpec, TypeVar, cast, overload

from ..core import validate_idempotency_key, validate_tenant
from ..errors import ConfigurationError, InvalidIdempotencyKey, UnencodableRequest
from ._rules import payload_fingerprint
from ._run import StoreArg, async_store, check_store, run_async, run_sync, sync_store
from ._values import DEFAULT_LEASE, DEFAULT_RETENTION, EffectResult, Policy, Target, make_policy

__all__ = [
    "AsyncIdempotentFunction",
    "IdempotentFunction",
    "idempotent",
    "key_text",
    "tenant_of",
]

P = ParamSpec("P")
R = TypeVar("R")
ExcTypes = type[Exception] | tuple[type[Exception], ...]


def key_text(value: object) -> str:
    """A key as stored: text, or an integer or UUID spelled as text (42 and "42" are one
    key). ``InvalidIdempotencyKey`` for anything else, or text that is no valid key."""
    if isinstance(value, uuid.UUID) or (isinstance(value, int) and not isinstance(value, bool)):
        value = str(value)
    return validate_idempotency_key(value)


def tenant_of(tenant: object) -> str:
    return validate_tenant(tenant)


class _Arguments:
    """How one function's calls become targets: key, tenant and fingerprint."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        key: str | Callable[..., object],
        fingerprint: Callable[..., Any] | None,
        tenant: str | Callable[..., object],
    ) -> None:
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.signature = inspect.signature(fn)
        if isinstance(key, str) and key not in self.signature.parameters:
            raise ConfigurationError(f"key={key!r} names no parameter of {self.name}")
        if not isinstance(key, str) and not callable(key):
            raise ConfigurationError("key is a parameter's name or a function of the arguments")
        if isinstance(tenant, str):
            tenant_of(tenant)  # a fixed tenant is code: refused now, not per call
        self.key, self.fingerprint, self.tenant = key, fingerprint, tenant

    def target(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Target:
        bound = self.signature.bind(*args, **kwargs)  # TypeError, as the call itself would
        bound.apply_defaults()
        if isinstance(self.key, str):
            raw_key = bound.arguments[self.key]
        else:
            raw_key = self.key(*args, **kwargs)
        try:
            key = key_text(raw_key)
        except InvalidIdempotencyKey as exc:
            raise InvalidIdempotencyKey(f"{self.name}: {exc.message}") from None
        tenant = self.tenant if isinstance(self.tenant, str) else self.tenant(*args, **kwargs)
        if self.fingerprint is None:
            payload: Any = dict(bound.arguments)
            hint = "pass fingerprint= (a function of the arguments returning the JSON that "
            hint += "decides the effect)"
        else:
            payload = self.fingerprint(*args, **kwargs)
            hint = "its fingerprint= must return JSON"
        try:
            digest = payload_fingerprint(payload)
        except UnencodableRequest as exc:
            raise UnencodableRequest(f"{self.name}: {exc.message}; {hint}") from None
        return Target(tenant_id=tenant_of(tenant), key=key, fingerprint=digest)


class IdempotentFunction(Generic[P, R]):
    """A function that runs once per key; call it as the function itself.

    A call returns the stored result (JSON's form of what the function returned: the same
    for the first call and every replay). :meth:`outcome` says whether it was replayed.
    """

    def __init__(
        self, fn: Callable[P, R], store: StoreArg, policy: Policy, arguments: _Arguments
    ) -> None:
        functools.update_wrapper(self, fn)
        self._fn, self._store, self.policy, self._arguments = fn, store, policy, arguments

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return cast("R", self.outcome(*args, **kwargs).value)

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> EffectResult:
        target = self._arguments.target(args, kwargs)
        store = sync_store(self._store)
        return run_sync(store, self.policy, target, lambda: self._fn(*args, **kwargs))


class AsyncIdempotentFunction(Generic[P, R]):
    """:class:`IdempotentFunction` for a coroutine function, on an ``AsyncStore``."""

    def __init__(
        self,
        fn: Callable[P, Awaitable[R]],
        store: StoreArg,
        policy: Policy,
        arguments: _Arguments,
    ) -> None:
        functools.update_wrapper(self, fn)
        self._fn, self._store, self.policy, self._arguments = fn, store, policy, arguments

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return cast("R", (await self.outcome(*args, **kwargs)).value)

    async def outcome(self, *args: P.args, **kwargs: P.kwargs) -> EffectResult:
        target = self._arguments.target(args, kwargs)
        store = async_store(self._store)
        return await run_async(store, self.policy, target, lambda: self._fn(*args, **kwargs))


class _Decorator:
    def __init__(self, store: StoreArg, policy: Policy, options: dict[str, Any]) -> None:
        check_store(store)
        self._store, self._policy, self._options = store, policy, options

    # A coroutine function matches both overloads: the first, narrower one applies.
    @overload
    def __call__(self, fn: Callable[P, Awaitable[R]]) -> AsyncIdempotentFunction[P, R]: ...  # type: ignore[overload-overlap]

    @overload
    def __call__(self, fn: Callable[P, R]) -> IdempotentFunction[P, R]: ...

    def __call__(self, fn: Callable[P, Any]) -> Any:
        arguments = _Arguments(fn, **self._options)
        if inspect.iscoroutinefunction(fn):
            check_store(self._store, asynchronous=True)
            return AsyncIdempotentFunction(fn, self._store, self._policy, arguments)
        check_store(self._store, asynchronous=False)
        return IdempotentFunction(fn, self._store, self._policy, arguments)


def idempotent(
    store: StoreArg,
    *,
    namespace: str,
    key: str | Callable[..., object],
    fingerprint: Callable[..., Any] | None = None,
    tenant: str | Callable[..., object] = "default",
    lease: timedelta = DEFAULT_LEASE,
    retention: timedelta = DEFAULT_RETENTION,
    retry_on: ExcTypes = (),
    final_on: ExcTypes = (),
    rerun_safe: bool = False,
    wait: timedelta | None = None,
    owner: str | None = None,
    key_scope: str | None = None,
) -> _Decorator:
    """Make a function's side effect happen once per ``key`` in ``namespace``.

    ``key``: the name of the parameter holding the key, or a function of the arguments.
    ``fingerprint``: a function of the arguments returning the JSON that decides the effect
    (default: every argument); the same key with another fingerprint is
    ``IdempotencyKeyReused``. ``tenant``: a tenant id or a function of the arguments.

    What the function raises decides what becomes of the key: ``retry_on`` (nothing
    happened: the claim is released and the same key runs again; the exception goes
    through), ``final_on`` (recorded, ``EffectFailed`` now and on every later call), and
    anything else may have happened: ``outcome_unknown``, escalated, never run again
    (``EffectOutcomeUnknown``). With ``rerun_safe=True`` (the downstream system dedupes on
    :func:`payorch.once.current`'s ``downstream_key``) such an effect, or one whose worker
    died, runs again instead, under the same downstream key.

    ``lease`` must outlast one run; ``wait`` bounds how long a duplicate waits for a run in
    progress before ``OperationInProgress``. Results must be JSON.
    """
    policy = make_policy(
        namespace=namespace,
        lease=lease,
        retention=retention,
        retry_on=retry_on,
        final_on=final_on,
        rerun_safe=rerun_safe,
        wait=wait,
        owner=owner,
        key_scope=key_scope,
    )
    return _Decorator(store, policy, {"key": key, "fingerprint": fingerprint, "tenant": tenant})
