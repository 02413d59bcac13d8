"""payorch.once: any effect once, for any inbound message or side-effecting function.

``execute()``'s rules, for what is not a provider call: the key is claimed in a namespace
with a fingerprint (one statement guarded by the key), a lease holds it while the effect
runs, a duplicate in flight is ``OperationInProgress``, a finished one replays its stored
result, and what may have happened but cannot be known is escalated, never run twice.

- :func:`idempotent`: a decorator for a function (sync or async) whose side effect is an
  email API call, a write to another ledger, anything that takes a key.
- :func:`consumer`: a decorator for the handler of inbound messages (webhooks from anyone,
  broker deliveries, jobs): key = message id, fingerprint = payload.
- :func:`claim`: the same as a context manager (``with`` / ``async with``).
- :func:`current`: the running effect (its ``downstream_key``, attempt).
- :func:`effect_answer`: the HTTP answer for a result or an error.
- :func:`escalated`, :func:`find`, :func:`get`, :func:`resolve`: the operator's side.

See ``docs/once.md``.
"""

from ._claim import EffectClaim, claim
from ._consumer import AsyncConsumer, Consumer, consumer, inbound
from ._functions import AsyncIdempotentFunction, IdempotentFunction, idempotent
from ._http import effect_answer
from ._operator import escalated, find, get, resolve
from ._run import current
from ._values import (
    DEFAULT_LEASE,
    DEFAULT_RETENTION,
    Effect,
    EffectRecord,
    EffectResult,
    InboundMessage,
)

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_RETENTION",
    "AsyncConsumer",
    "AsyncIdempotentFunction",
    "Consumer",
    "Effect",
    "EffectClaim",
    "EffectRecord",
    "EffectResult",
    "IdempotentFunction",
    "InboundMessage",
    "claim",
    "consumer",
    "current",
    "effect_answer",
    "escalated",
    "find",
    "get",
    "idempotent",
    "inbound",
    "resolve",
]
