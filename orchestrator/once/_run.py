"""Running one effect, sync or async, and what the running function can ask about itself.

The async form is the sync flow of :mod:`payorch.once._flow` run under
``storage._bridge.run_bridged``: its round trips await on the event loop, and the
coroutine being made idempotent is awaited from inside it (``wait_for``). So the two forms
decide alike, by the very same code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeAlias

from ..errors import ConfigurationError
from ..storage._async_store import AsyncStore
from ..storage._bridge import run_bridged, wait_for
from ..storage._store import Store
from ._flow import fail, finish, start
from ._values import Effect, EffectResult, Policy, Target

__all__ = [
    "StoreArg",
    "async_store",
    "check_store",
    "current",
    "drive",
    "entered",
    "left",
    "run_async",
    "run_sync",
    "sync_store",
]

# A store, or what makes one on first use (decorators are often applied at import time,
# before the application has opened its database).
StoreArg: TypeAlias = Store | AsyncStore | Callable[[], Store | AsyncStore]

_CURRENT: ContextVar[Effect | None] = ContextVar("payorch_once_effect", default=None)


def current() -> Effect:
    """The effect the calling code runs under (inside an ``idempotent`` function, a
    consumer's handler or a ``claim`` block): its id, attempt and ``downstream_key``."""
    effect = _CURRENT.get()
    if effect is None:
        raise ConfigurationError("payorch.once.current() is only known while an effect runs")
    return effect


def entered(effect: Effect) -> Any:
    return _CURRENT.set(effect)


def left(token: Any) -> None:
    _CURRENT.reset(token)


def _resolve(store: StoreArg) -> Store | AsyncStore:
    if isinstance(store, Store | AsyncStore):
        return store
    made = store()
    if not isinstance(made, Store | AsyncStore):
        raise ConfigurationError(f"the store factory returned {made!r}, not a Store or AsyncStore")
    return made


def check_store(store: object, *, asynchronous: bool | None = None) -> None:
    """Refuse, when a form is built, a store that is none or of the wrong kind for it
    (``asynchronous``: None, either kind). A factory is checked on first use."""
    if not isinstance(store, Store | AsyncStore):
        if callable(store):
            return
        raise ConfigurationError(
            f"store must be a Store, an AsyncStore or a function returning one, not {store!r}"
        )
    if asynchronous is True:
        async_store(store)
    elif asynchronous is False:
        sync_store(store)


def sync_store(store: StoreArg) -> Store:
    found = _resolve(store)
    if isinstance(found, AsyncStore):
        # Its connections belong to an event loop: blocking calls on it would stall it.
        raise ConfigurationError(
            "an AsyncStore serves async functions and `async with`; a sync function or "
            "`with` needs a Store"
        )
    return found


def async_store(store: StoreArg) -> AsyncStore:
    found = _resolve(store)
    if isinstance(found, Store):
        # Its round trips would block the event loop.
        raise ConfigurationError(
            "a Store serves sync functions and `with`; an async function or `async with` "
            "needs an AsyncStore"
        )
    return found


def drive(
    store: Store, policy: Policy, target: Target, call: Callable[[Effect], Any]
) -> EffectResult:
    """Claim, run ``call``, record; or the stored answer. Both forms run this."""
    started = start(store, policy, target)
    if isinstance(started, EffectResult):
        return started
    try:
        value = call(started.effect)
    except Exception as exc:
        # BaseException (KeyboardInterrupt, a cancelled task) is a crash: nothing is
        # written, and the lapsed lease decides, as after kill -9.
        err = fail(store, started, exc)
        if err is None:
            raise
        if isinstance(err, EffectResult):
            return err  # the key succeeded meanwhile (this run had lost its lease): that stands
        raise err from exc
    return finish(store, started, value)


def run_sync(store: Store, policy: Policy, target: Target, call: Callable[[], Any]) -> EffectResult:
    """:func:`drive` for a plain function, with :func:`current` set while it runs."""

    def under(effect: Effect) -> Any:
        token = entered(effect)
        try:
            return call()
        finally:
            left(token)

    return drive(store, policy, target, under)


async def run_async(
    store: AsyncStore,
    policy: Policy,
    target: Target,
    call: Callable[[], Awaitable[Any]],
) -> EffectResult:
    """:func:`drive` for a coroutine function, on the event loop."""

    async def under(effect: Effect) -> Any:
        # Set inside the coroutine: it runs in the task's context, not the bridge's.
        token = entered(effect)
        try:
            return await call()
        finally:
            left(token)

    def awaited(effect: Effect) -> Any:
        return wait_for(under(effect))

    return await run_bridged(drive, store.sync, policy, target, awaited)
