"""Functions run in child processes by the race tests (importable by 'spawn')."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

from payorch.errors import OperationInProgress
from payorch.records import NewOperation
from payorch.storage._store import Store


def claim_many(url: str, worker: int, keys: list[str]) -> list[tuple[str, str, bool]]:
    """Claim every key (in a worker-specific order); report (key, operation id, created)."""
    store = Store.from_url(url)
    order = list(keys)
    random.Random(worker).shuffle(order)
    out: list[tuple[str, str, bool]] = []
    try:
        for key in order:
            new = NewOperation(
                tenant_id="race",
                operation="payment.create",
                idempotency_key=key,
                fingerprint="f" * 64,
                provider="sandbox",
            )
            try:
                res = store.claim(new, owner=f"worker-{worker}", lease=timedelta(seconds=60))
                out.append((key, res.operation.id, res.created))
            except OperationInProgress as exc:
                assert exc.operation_id is not None
                out.append((key, exc.operation_id, False))
    finally:
        store.close()
    return out


def execute_then_die(url: str, sandbox_url: str, key: str, point: str = "after_commit") -> None:
    """Run execute() and SIGKILL this process at ``point``:

    - ``before_send``: the claim is committed, nothing sent yet;
    - ``after_commit``: the provider committed, our outcome not yet recorded;
    - ``between_retries``: a not-sent attempt is recorded, the retry not yet sent;
    - ``after_record``: execute() has returned (nothing left to do).
    """
    import os
    import signal

    from payorch.execution._executor import Executor
    from payorch.operations import default_registry
    from payorch.provider import Answer, SubmitRequest
    from payorch.providers.sandbox import SandboxProvider

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    class Dies(SandboxProvider):
        def submit(self, request: SubmitRequest) -> Answer:
            if point == "before_send":
                die()
            answer = super().submit(request)
            if point == "after_commit":
                die()
            return answer

    store = Store.from_url(url)
    ex = Executor(
        store=store,
        providers=[Dies(base_url=sandbox_url)],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=120),
        sleep=lambda _seconds: die() if point == "between_retries" else None,
    )
    ex.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={"amount": 1250, "currency": "EUR", "customer": "cus_7"},
    )
    if point == "after_record":
        die()


def reconcile_until_idle(
    url: str, sandbox_url: str, worker: int, start: Any = None
) -> dict[str, int]:
    """One reconciler process: passes until nothing is due; returns its outcome counts.

    ``start`` (a barrier proxy) lines the processes up, so a slow spawn cannot leave one
    of them with no work at all.
    """
    from payorch.providers.sandbox import SandboxProvider
    from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy

    store = Store.from_url(url)
    if start is not None:
        start.wait(timeout=60)
    try:
        with SandboxProvider(base_url=sandbox_url) as provider:
            rec = Reconciler(
                store=store,
                providers=[provider],
                policy=ReconcilerPolicy(batch_size=25),
                owner=f"reconciler-{worker}",
            )
            return dict(rec.run_until_idle(max_passes=200).outcomes)
    finally:
        store.close()


def run_until_killed(url: str, sandbox_url: str, key: str, point: str = "after_commit") -> None:
    """Run :func:`execute_then_die` in a fresh process and check that SIGKILL ended it."""
    import multiprocessing
    import signal

    proc = multiprocessing.get_context("spawn").Process(
        target=execute_then_die, args=(url, sandbox_url, key, point)
    )
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL, f"the worker ended with {proc.exitcode}"


def route_then_die(url: str, down_url: str, live_url: str, key: str) -> None:
    """A routed execute() whose first provider refuses the connection: the move to the
    second is recorded, then this process is SIGKILLed as that provider is called, before a
    byte reaches it."""
    import os
    import signal

    from payorch.execution._executor import Executor
    from payorch.operations import default_registry
    from payorch.provider import Answer, SubmitRequest
    from payorch.providers.sandbox import SandboxProvider
    from payorch.routing import Router, Rule

    class Dies(SandboxProvider):
        def submit(self, request: SubmitRequest) -> Answer:
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

    store = Store.from_url(url)
    ex = Executor(
        store=store,
        providers=[
            SandboxProvider(base_url=down_url, name="acquirer_a"),
            Dies(base_url=live_url, name="acquirer_b"),
        ],
        registry=default_registry("acquirer_a"),
        lease=timedelta(seconds=120),
        router=Router([Rule(operation="payment.create", providers=["acquirer_a", "acquirer_b"])]),
    )
    ex.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request={"amount": 1250, "currency": "EUR", "customer": "cus_7"},
    )


def run_routed_until_killed(url: str, down_url: str, live_url: str, key: str) -> None:
    """:func:`route_then_die` in a fresh process; checks that SIGKILL ended it."""
    import multiprocessing
    import signal

    proc = multiprocessing.get_context("spawn").Process(
        target=route_then_die, args=(url, down_url, live_url, key)
    )
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL, f"the worker ended with {proc.exitcode}"
