"""The demo's routing: payments routed across two sandbox acquirers, the first of which goes
down mid-run. Each move to the second one happens on proof only, the reconciler asks every
acquirer an operation touched, and the run counts the money at both: one effect per
operation, none at two acquirers."""

from __future__ import annotations

import random
from collections import Counter
from datetime import timedelta
from typing import Any

import httpx
from rich.console import Console

from ..errors import PayorchError
from ..execution._executor import Executor, RetryPolicy
from ..operations import default_registry
from ..providers.sandbox import SandboxProvider, SandboxServer
from ..reconciling._crossings import CrossCheck
from ..reconciling._fallback_watch import FallbackWatch
from ..reconciling._reconciler import Reconciler, ReconcilerPolicy
from ..routing import HealthPolicy, Router, Rule, attempts_of
from ..storage._store import Store

__all__ = ["route_across"]

A, B = "acquirer_a", "acquirer_b"
TIMEOUT = httpx.Timeout(connect=1.0, read=0.5, write=1.0, pool=1.0)
MONEY = ("succeeded", "processing")


def route_across(
    store: Store, tenant: str, payments: int, seed: int, console: Console
) -> list[tuple[str, int, int]]:
    """Route ``payments`` payments (a quarter of the demo's, at least 20) across two
    acquirers, stop the first halfway, settle; the checks it must pass, for the report."""
    count = max(20, payments // 4)
    rnd = random.Random(seed)  # noqa: S311 - a seeded simulation, not security
    with (
        SandboxServer(seed=seed, fault_rates={"decline": 0.1}) as a,
        SandboxServer(seed=seed + 1) as b,
        SandboxProvider(base_url=a.url, name=A, timeout=TIMEOUT) as pa,
        SandboxProvider(base_url=b.url, name=B, timeout=TIMEOUT) as pb,
    ):
        router = Router(
            [
                Rule(
                    operation="payment.create",
                    name="eu-first",
                    providers=[A, B],
                    currencies=["EUR"],
                ),
                Rule(
                    operation="payment.create", name="split", providers=[A, B], split={A: 70, B: 30}
                ),
            ],
            fallback_declines=["generic_decline"],  # the demo's issuer declines are soft
            health=HealthPolicy(calls=4, min_calls=3, cool_off=timedelta(minutes=5)),
        )
        executor = Executor(
            store=store,
            providers=[pa, pb],
            registry=default_registry(A),
            lease=timedelta(seconds=30),
            retry=RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.2),
            router=router,
        )
        ids: list[str] = []
        for i in range(count):
            if i == count // 2:
                a.stop()  # acquirer_a goes down: connection refused from now on
            request = {
                "amount": rnd.randrange(100, 50_000),
                "currency": rnd.choice(["EUR", "USD"]),
                "customer": f"cus_{rnd.randrange(1000)}",
            }
            for _ in range(2):  # the client's retry: the same key, the same operation
                try:
                    out = executor.execute(
                        tenant_id=tenant,
                        operation="payment.create",
                        idempotency_key=f"routed-{i}",
                        request=request,
                    )
                except PayorchError:
                    continue
                if out.operation_id not in ids:
                    ids.append(out.operation_id)
        crossings = CrossCheck(store=store, providers={A: pa, B: pb}, owner="demo")
        rec = Reconciler(
            store=store,
            providers=[pa, pb],
            policy=ReconcilerPolicy(not_found_grace=timedelta(0)),
            owner="demo",
            tenant_ids=[tenant],
            crossings=crossings,
        )
        rec.run_until_idle()
        watch = FallbackWatch(store=store, crossings=crossings, ages=(timedelta(0),))
        looked = watch.check({(tenant, i) for i in ids})
        return _judge(
            store, tenant, ids=ids, acquirers={A: a, B: b}, looked=looked, console=console
        )


def _judge(
    store: Store,
    tenant: str,
    *,
    ids: list[str],
    acquirers: dict[str, SandboxServer],
    looked: dict[str, int],
    console: Console,
) -> list[tuple[str, int, int]]:
    records = [store.get(tenant, i) for i in ids]
    ledgers = {name: sb.ledger() for name, sb in acquirers.items()}
    proofs: Counter[str] = Counter()
    skipped = 0
    at_two = wrong = 0
    settled: Counter[str] = Counter()
    for record in records:
        steps = attempts_of(record.route)
        proofs.update(str(s["proof"]) for s in steps if s.get("proof"))
        skipped += bool((record.route or {}).get("skipped"))
        held: dict[str, int] = {}
        for step in steps:
            key = step.get("downstream_key")
            held[step["provider"]] = sum(
                1
                for e in ledgers[step["provider"]]
                if e["idempotency_key"] == key and e["status"] in MONEY
            )
        at_two += sum(1 for n in held.values() if n) > 1
        want = 1 if record.state.value == "succeeded" else 0
        wrong += held.get(record.provider, 0) != want or sum(held.values()) != want
        settled[f"{record.provider}:{record.state.value}"] += 1
    console.print(
        f"routing: {len(records)} payments across {A} and {B}; {A} went down halfway; "
        f"settled {dict(sorted(settled.items()))}"
    )
    console.print(
        f"  fallbacks: {sum(proofs.values())} {dict(sorted(proofs.items()))}; "
        f"{skipped} new payments passed {A} over as unhealthy"
    )
    console.print(f"  cross-provider duplicates: {looked.get('flagged', 0) + at_two}")
    return [
        ("routed operations with money at two acquirers", at_two, 0),
        ("routed operations without exactly their own effect", wrong, 0),
        ("cross-provider duplicates found by the reconciler", _found(looked), 0),
    ]


def _found(looked: dict[str, Any]) -> int:
    return sum(n for what, n in looked.items() if what not in ("clear", "unchecked", "pending"))
