"""The two acquirers of the routing tests: their adapters, a routed executor, a reconciler
with the cross-provider check, and how a test pays and counts money (the fixtures that
start the acquirers and close the adapters are in conftest.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from conftest import FAST_TIMEOUT, RecordingSleep

from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.provider import STATUS_CAPABILITIES, AnswerKind, Capability
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._crossings import CrossCheck, DuplicatePolicy
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.routing import HealthPolicy, Router, Rule
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

A, B = "acquirer_a", "acquirer_b"
PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
MONEY = ("succeeded", "processing")


OPEN: list[SandboxProvider] = []  # closed by conftest's acquirers fixture


def close_opened() -> None:
    while OPEN:
        OPEN.pop().close()


def adapters(a_url: str, b_url: str) -> list[SandboxProvider]:
    made = [
        SandboxProvider(base_url=a_url, name=A, timeout=FAST_TIMEOUT),
        SandboxProvider(base_url=b_url, name=B, timeout=FAST_TIMEOUT),
    ]
    OPEN.extend(made)
    return made


class WebhookOnly(SandboxProvider):
    """The sandbox adapter, told it cannot be asked for a status (a webhook-only acquirer)."""

    @property
    def capabilities(self) -> frozenset[Capability]:
        return super().capabilities - STATUS_CAPABILITIES


def executor(
    store: Store, providers: list[SandboxProvider], *, declines: tuple[str, ...] = ()
) -> Executor:
    rule = Rule(operation="payment.create", providers=[A, B], name="eu")
    return Executor(
        store=store,
        providers=providers,
        registry=default_registry(A),
        lease=timedelta(seconds=60),
        sleep=RecordingSleep(),
        router=Router([rule], fallback_declines=declines, health=None),
    )


def reconciler(
    store: Store, providers: list[SandboxProvider], policy: DuplicatePolicy
) -> Reconciler:
    rec = Reconciler(
        store=store,
        providers=providers,
        policy=ReconcilerPolicy(not_found_grace=timedelta(0)),
        owner="reconciler-test",
    )
    refunds = Executor(store=store, providers=providers, owner="reconciler-test")
    rec.crossings = CrossCheck(
        store=store,
        providers=rec.providers,
        owner=rec.owner,
        policy=policy,
        refunds=refunds,
    )
    return rec


def pay(ex: Executor, key: str = "order-1", **request: Any) -> Any:
    return ex.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={**PAYMENT, **request},
    )


def money(sandbox: SandboxServer, operation: str = "payment.create") -> list[dict[str, Any]]:
    """The money the acquirer moved for ``operation``: every effect that succeeded."""
    return [e for e in sandbox.ledger() if e["status"] in MONEY and e["operation"] == operation]


def lose(store: Store, operation_id: str) -> None:
    """What an asynchronous replica's promotion does to a committed claim: gone."""
    with store.engine.begin() as conn:
        conn.execute(sa.delete(events).where(events.c.operation_id == operation_id))
        conn.execute(sa.delete(operations).where(operations.c.id == operation_id))


def lost_then_routed_past_a(store: Store, providers: list[SandboxProvider]) -> tuple[Any, Any]:
    """A payment charged at A whose claim a failover loses; the client's retry, A looking
    unhealthy here meanwhile, routed to B first: charged at both (a double fault). The
    first outcome and the retry's."""
    first = pay(executor(store, providers))
    assert first.provider == A
    lose(store, first.operation_id)
    router = Router(
        [Rule(operation="payment.create", providers=[A, B])],
        health=HealthPolicy(calls=2, min_calls=2),
        clock=lambda: 0.0,
    )
    for _ in range(2):
        router.health.observe(A, AnswerKind.NOT_SENT)
    again = Executor(store=store, providers=providers, registry=default_registry(A), router=router)
    retry = pay(again)
    assert retry.provider == B and retry.operation_id != first.operation_id
    return first, retry


def stopped() -> str:
    """The address of an acquirer that is down: nothing listens there any more."""
    with SandboxServer() as gone:
        return gone.url


def sample(name: str, **labels: str) -> float:
    """A metric's value now (0 when never recorded)."""
    from payorch.observing import _metrics

    assert _metrics.registry is not None
    return _metrics.registry.get_sample_value(name, labels) or 0.0
