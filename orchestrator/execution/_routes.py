"""Routing in the executor: the route a new request takes, and the move to the next
provider once an attempt is proven not to have executed (``payorch.routing``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..core import namespace_ref
from ..observing import _routing as routing_metrics
from ..operations import Prepared
from ..provider import Answer
from ..records import OperationRecord
from ..routing import Proof, Router, first_route, key_at, moved, next_provider, proves_not_sent

__all__ = ["Fallback", "fallback_for", "routed"]


def routed(prepared: Prepared, router: Router, key_scope: str) -> Prepared:
    """``prepared`` with its route chosen (``NoRoute`` if no rule matches: nothing stored)
    and its first provider's downstream key."""
    new = prepared.new
    choice = router.choose(
        tenant_id=new.tenant_id,
        operation=new.operation,
        idempotency_key=new.idempotency_key,
        request=prepared.payload,
        amount=new.amount,
        currency=new.currency,
        key_scope=key_scope,
    )
    for provider in choice.skipped:
        routing_metrics.skipped_unhealthy(provider)
    ref = namespace_ref(new.tenant_id, new.operation, new.idempotency_key, key_scope)
    route = first_route(choice, ref)
    return replace(prepared, new=replace(new, provider=choice.providers[0], route=route))


@dataclass(frozen=True)
class Fallback:
    """Where a routed operation's current attempt may move: provider ``to`` under ``key``,
    once an answer proves it did not execute (:meth:`proof`)."""

    router: Router
    to: str
    key: str
    route: Mapping[str, Any]
    # The request the next provider will be sent, as a claim keeps it (WireRequest.stored()),
    # built only on a move; None: none kept (the adapter cannot say).
    wire: Callable[[], Mapping[str, Any] | None] | None = field(default=None, compare=False)

    def proof(self, answer: Answer) -> Proof | None:
        if proves_not_sent(answer):
            return Proof.NOT_SENT
        if self.router.may_fall_back(answer.kind, answer.code):
            return Proof.LISTED_DECLINE
        return None

    def moved_route(self, proof: Proof, answer: Answer, known: str | None) -> dict[str, Any]:
        """The route once moved on ``answer``'s proof (``known``: the reference the
        operation held of the attempt left)."""
        reference = answer.provider_reference or known
        return moved(
            self.route, proof=proof, code=answer.code, to=self.to, key=self.key, reference=reference
        )


def fallback_for(
    record: OperationRecord,
    router: Router | None,
    visited: Collection[str],
    usable: Collection[str],
) -> Fallback | None:
    """The move open to ``record`` if its current attempt proves not executed: its route's
    next provider not yet tried in this call; None when unrouted or the route is spent."""
    if record.route is None or router is None:
        return None
    to = next_provider(record.route, visited, usable)
    key = key_at(record.route, to) if to is not None else None
    if to is None or key is None:
        return None
    return Fallback(router, to, key, record.route)
