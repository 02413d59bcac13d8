"""``claim(...)``: the context-manager form, for code that cannot be one function.

::

    with once.claim(store, "ledger.post", key, payload) as effect:
        if effect.replayed:
            return effect.result
        post(entry, idempotency_key=effect.downstream_key)
        effect.succeed({"posted": entry.id})

Entering claims the key (a duplicate in flight, a reused key, a recorded failure or an
escalated effect raise there, before the block runs); leaving records: the block's result
if it ended normally (``succeed``'s value, else None), or what its exception means, as
for :func:`payorch.once.idempotent`. ``async with`` does the same on an ``AsyncStore``.
After the block, ``result`` is what the key holds: a block that outran its lease while
another call settled the key gets that call's answer (``replayed`` true; its exception, if
the key succeeded, is not raised).
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType
from typing import Any

from ..errors import ConfigurationError, InvalidIdempotencyKey, UnencodableRequest
from ..storage._bridge import run_bridged
from ..storage._store import Store
from ._flow import Running, fail, finish, start
from ._functions import ExcTypes, key_text, tenant_of
from ._rules import payload_fingerprint
from ._run import StoreArg, async_store, check_store, entered, left, sync_store
from ._values import (
    DEFAULT_LEASE,
    DEFAULT_RETENTION,
    Effect,
    EffectResult,
    Policy,
    Target,
    effect_downstream_key,
    make_policy,
)

__all__ = ["EffectClaim", "claim"]


class EffectClaim:
    """One claimed effect, for the length of a ``with`` block (one use only).

    ``replayed``: the effect ran before, ``result`` is its stored result and the block
    must not run it again. Otherwise the block runs it, under ``downstream_key``, and says
    what came of it with :meth:`succeed` (or raises).
    """

    def __init__(self, store: StoreArg, policy: Policy, target: Target) -> None:
        self._store, self._policy, self._target = store, policy, target
        self._running: Running | None = None
        self._effect: Effect | None = None
        self._used = False
        self._token: Any = None
        self._decided = False
        self.replayed = False
        self.result: Any = None

    @property
    def effect(self) -> Effect:
        if self._effect is None:
            raise ConfigurationError("the effect is known once its `with` block is entered")
        return self._effect

    @property
    def id(self) -> str:
        return self.effect.id

    @property
    def downstream_key(self) -> str:
        return self.effect.downstream_key

    @property
    def attempt(self) -> int:
        return self.effect.attempt

    @property
    def rerun(self) -> bool:
        return self.effect.rerun

    def succeed(self, result: Any = None) -> None:
        """The effect happened and ``result`` (JSON) is what every call under the key gets.
        Recorded when the block ends, even if it ends with an exception after this."""
        if self.replayed:
            raise ConfigurationError(f"effect {self.id} was replayed: it does not run again")
        if self._running is None:
            raise ConfigurationError("succeed() belongs inside the claim's `with` block")
        self.result, self._decided = result, True

    # -- sync --------------------------------------------------------------------------

    def __enter__(self) -> EffectClaim:
        self._begin(sync_store(self._store))
        self._token = entered(self.effect)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        left(self._token)
        return self._end(sync_store(self._store), exc)

    # -- async -------------------------------------------------------------------------

    async def __aenter__(self) -> EffectClaim:
        store = async_store(self._store)
        await run_bridged(self._begin, store.sync)
        self._token = entered(self.effect)  # here, in the task's own context
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        left(self._token)
        store = async_store(self._store)
        return await run_bridged(self._end, store.sync, exc)

    # -- shared ------------------------------------------------------------------------

    def _begin(self, store: Store) -> None:
        if self._used:
            raise ConfigurationError("a claim is entered once; claim the key again instead")
        self._used = True
        started = start(store, self._policy, self._target)
        if isinstance(started, EffectResult):
            self.replayed, self.result = True, started.value
            self._effect = Effect(
                id=started.effect_id,
                tenant_id=started.tenant_id,
                namespace=started.namespace,
                key=started.key,
                downstream_key=effect_downstream_key(
                    started.tenant_id, started.namespace, started.key, self._policy.key_scope
                ),
                attempt=started.attempts,
                rerun=False,
            )
            return
        self._running, self._effect = started, started.effect

    def _end(self, store: Store, exc: BaseException | None) -> bool:
        running, self._running = self._running, None
        if running is None:  # a replay: nothing ran, nothing to record
            return False
        if exc is None or (self._decided and isinstance(exc, Exception)):
            done = finish(store, running, self.result)
            self.replayed, self.result = done.replayed, done.value  # what is stored
            return False  # an exception raised after succeed() goes on as it is
        if not isinstance(exc, Exception):
            return False  # a crash (KeyboardInterrupt, cancelled): the lapsed lease decides
        err = fail(store, running, exc)
        if err is None:
            return False  # retry_on / rerun_safe: the exception goes on, the key runs again
        if isinstance(err, EffectResult):
            # The block outran its lease and the key succeeded meanwhile: that result is
            # the answer, as for a function; the block's exception is not.
            self.replayed, self.result = True, err.value
            return True
        raise err from exc


def claim(
    store: StoreArg,
    namespace: str,
    key: object,
    payload: Any = None,
    *,
    tenant: str = "default",
    lease: timedelta = DEFAULT_LEASE,
    retention: timedelta = DEFAULT_RETENTION,
    retry_on: ExcTypes = (),
    final_on: ExcTypes = (),
    rerun_safe: bool = False,
    wait: timedelta | None = None,
    owner: str | None = None,
    key_scope: str | None = None,
) -> EffectClaim:
    """Claim ``key`` in ``namespace`` for a ``with`` (or ``async with``) block; ``payload``
    (JSON or bytes) is fingerprinted. Options as for :func:`payorch.once.idempotent`."""
    check_store(store)
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
    try:
        text = key_text(key)
    except InvalidIdempotencyKey as exc:
        raise InvalidIdempotencyKey(f"claim in {namespace!r}: {exc.message}") from None
    try:
        digest = payload_fingerprint(payload)
    except UnencodableRequest as exc:
        raise UnencodableRequest(f"claim in {namespace!r}: {exc.message}") from None
    target = Target(tenant_id=tenant_of(tenant), key=text, fingerprint=digest)
    return EffectClaim(store, policy, target)
