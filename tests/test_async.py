"""The async API: AsyncExecutor, AsyncStore, AsyncWebhookHandler, AsyncReconciler.

Every executor test also runs through AsyncExecutor (the ``executor`` fixture is parametrised
over sync and async); these are the properties only concurrency on one event loop shows.
Real PostgreSQL and SQLite, the real sandbox on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from conftest import FAST_TIMEOUT, effects_of, make_due
from stripe_helpers import OP_ID, PI_ID, payment_intent, query, search_result
from test_deadline import GAP, SHORT, TRICKLE_TIMEOUT
from test_webhooks import signed

from payorch import AsyncExecutor, AsyncReconciler, AsyncStore, AsyncWebhookHandler, WebhookStatus
from payorch.core import State
from payorch.errors import ConfigurationError, OperationInProgress
from payorch.operations import default_registry
from payorch.outcome import Outcome
from payorch.provider import Answer, AnswerKind, DeadlineExceeded, SubmitRequest
from payorch.providers.sandbox import Fault, SandboxProvider, SandboxServer
from payorch.providers.stripe import StripeProvider
from payorch.reconciling._reconciler import ReconcilerPolicy
from payorch.storage._store import Store

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
MONEY = ("succeeded", "processing")


def money_effects(sandbox: SandboxServer, store: Store, operation_id: str) -> list[dict[str, Any]]:
    return [e for e in effects_of(sandbox, store, "shop", operation_id) if e["status"] in MONEY]


@contextlib.asynccontextmanager
async def async_executor(
    db_url: str, provider: Any, *, lease: timedelta = timedelta(seconds=30)
) -> AsyncIterator[AsyncExecutor]:
    store = AsyncStore.from_url(db_url)
    try:
        yield AsyncExecutor(
            store=store,
            providers=[provider],
            registry=default_registry("sandbox"),
            lease=lease,
            owner="async-test",
        )
    finally:
        await store.close()


async def pay(ex: AsyncExecutor, key: str = "k1", **kwargs: Any) -> Outcome:
    return await ex.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request=PAYMENT,
        **kwargs,
    )


def test_fifty_concurrent_identical_requests_make_one_effect(
    db_url: str, sandbox: SandboxServer, store: Store
) -> None:
    async def main() -> list[Outcome | BaseException]:
        async with (
            SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT) as provider,
            async_executor(db_url, provider) as ex,
        ):
            return await asyncio.gather(*(pay(ex) for _ in range(50)), return_exceptions=True)

    results = asyncio.run(main())
    outcomes = [r for r in results if isinstance(r, Outcome)]
    refused = [r for r in results if not isinstance(r, Outcome)]
    assert all(isinstance(r, OperationInProgress) for r in refused), refused
    assert len(outcomes) + len(refused) == 50
    assert sum(not o.replayed for o in outcomes) == 1  # exactly one request executed
    ids = {o.operation_id for o in outcomes} | {getattr(r, "operation_id", None) for r in refused}
    assert ids == {outcomes[0].operation_id}
    assert all(o.state is State.SUCCEEDED for o in outcomes)
    assert len(sandbox.ledger()) == 1
    assert len(money_effects(sandbox, store, outcomes[0].operation_id)) == 1


class Gated:
    """The sandbox adapter, held at the gate before it sends (an operation in progress)."""

    def __init__(self, inner: SandboxProvider) -> None:
        self.inner = inner
        self.name = inner.name
        self.idempotency_window = inner.idempotency_window
        self.max_call_duration = inner.max_call_duration
        self.reached = asyncio.Event()
        self.gate = asyncio.Event()

    async def asubmit(self, request: SubmitRequest) -> Answer:
        self.reached.set()
        await self.gate.wait()
        return await self.inner.asubmit(request)

    async def aquery_status(self, query: Any) -> Answer:
        return await self.inner.aquery_status(query)

    def parse_webhook(self, headers: Any, body: bytes) -> Any:
        return self.inner.parse_webhook(headers, body)


def test_a_waiting_duplicate_leaves_the_loop_to_other_coroutines(
    db_url: str, sandbox: SandboxServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a duplicate waits for the first request (``wait=``), other coroutines run
    *between* its reads of the operation, i.e. during its naps: the wait does not hold the
    loop. The first request can only finish when such a coroutine opens its gate."""
    log: list[str] = []

    async def main() -> tuple[Outcome, Outcome]:
        async with (
            SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT) as inner,
            async_executor(db_url, Gated(inner)) as ex,
        ):
            gated = ex.providers["sandbox"]
            assert isinstance(gated, Gated)

            def spied(read: Any) -> Any:
                def spied_read(*args: Any) -> Any:
                    log.append("read")
                    try:
                        return read(*args)
                    finally:
                        log.append("read done")

                return spied_read

            # A waiter's look is ``_reread`` (it counts the replay a wait ends in).
            for name in ("get", "_reread"):
                monkeypatch.setattr(ex.store.sync, name, spied(getattr(ex.store.sync, name)))
            first = asyncio.create_task(pay(ex))
            await gated.reached.wait()
            duplicate = asyncio.create_task(pay(ex, wait=timedelta(seconds=60)))
            # Bounded by time, not by a count of ticks (a loaded machine may be slow to reach
            # the first nap); one entry per run of ticks keeps the log short.
            deadline = time.monotonic() + 60
            while not ticked_during_a_nap(log) and time.monotonic() < deadline:
                if not log or log[-1] != "tick":
                    log.append("tick")
                await asyncio.sleep(0)
            assert not duplicate.done()  # still waiting: the first is held at the gate
            gated.gate.set()
            return await first, await duplicate

    first, duplicate = asyncio.run(main())
    assert ticked_during_a_nap(log)
    assert first.state is State.SUCCEEDED and not first.replayed
    assert duplicate.replayed and duplicate.operation_id == first.operation_id
    assert len(sandbox.ledger()) == 1


def ticked_during_a_nap(log: list[str]) -> bool:
    """A tick after the waiter finished one read and before it began the next.

    Between the two the waiter's synchronous code yields to the loop only if its nap awaits;
    a nap that blocked the thread would leave no room for a tick there.
    """
    napping = False
    for entry in log:
        if entry == "read done":
            napping = True
        elif entry == "read":
            napping = False
        elif napping:
            return True
    return False


def test_the_async_deadline_bounds_a_trickled_answer_unknown_then_settled_once(
    db_url: str, store: Store
) -> None:
    async def main(trickling: SandboxServer) -> tuple[Outcome, Counter[str]]:
        async with (
            SandboxProvider(
                base_url=trickling.url, timeout=TRICKLE_TIMEOUT, deadline=SHORT
            ) as provider,
            async_executor(db_url, provider, lease=timedelta(seconds=10)) as ex,
        ):
            trickling.inject(Fault.TRICKLE)
            outcome = await pay(ex)
            await asyncio.to_thread(make_due, store, outcome.operation_id)
            reconciler = AsyncReconciler(
                store=ex.store,
                providers=[provider],
                policy=ReconcilerPolicy(lease=timedelta(seconds=10)),
                owner="async-reconciler",
            )
            report = await reconciler.reconcile_once()
            return outcome, report.outcomes

    with SandboxServer(trickle_interval=GAP) as trickling:
        outcome, settled = asyncio.run(main(trickling))
        assert outcome.state is State.OUTCOME_UNKNOWN
        assert outcome.error_code == "deadline_exceeded"
        answer = next(e for e in store.events("shop", outcome.operation_id) if e.kind != "claimed")
        assert answer.detail is not None and answer.detail["possibly_sent"] is True
        assert settled == Counter({"succeeded": 1})
        record = store.get("shop", outcome.operation_id)
        effects = effects_of(trickling, store, "shop", outcome.operation_id)
        assert len(effects) == 1 and record.provider_reference == effects[0]["id"]
        assert record.state is State.SUCCEEDED


def test_an_async_webhook_settles_an_unknown_operation_and_replays_show_it(
    db_url: str, sandbox: SandboxServer, store: Store
) -> None:
    async def main() -> tuple[Outcome, WebhookStatus, WebhookStatus, Outcome]:
        async with (
            SandboxProvider(
                base_url=sandbox.url, webhook_secret=sandbox.webhook_secret, timeout=FAST_TIMEOUT
            ) as provider,
            async_executor(db_url, provider) as ex,
        ):
            sandbox.inject("drop_after")
            first = await pay(ex)
            sent = (await ex.store.get("shop", first.operation_id)).downstream_key
            (effect,) = sandbox.effects_for(sent)
            event = {"id": "evt_async_1", "type": "effect.succeeded", "data": effect}
            headers, body = signed(sandbox.webhook_secret, event)
            handler = AsyncWebhookHandler(store=ex.store, providers=[provider])
            applied = await handler.handle("shop", "sandbox", headers, body)
            again = await handler.handle("shop", "sandbox", headers, body)
            return first, applied.status, again.status, await pay(ex)

    first, applied, again, replay = asyncio.run(main())
    assert first.state is State.OUTCOME_UNKNOWN
    assert (applied, again) == (WebhookStatus.APPLIED, WebhookStatus.DUPLICATE)
    assert replay.state is State.SUCCEEDED and replay.replayed
    assert len(money_effects(sandbox, store, first.operation_id)) == 1


def test_the_stripe_status_flow_answers_alike_sync_and_async() -> None:
    """A search and its fresh reads, made by the sync and by the async driver."""
    calls: list[str] = []

    def reply(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path.endswith("/search"):
            return httpx.Response(200, json=search_result(payment_intent("processing")))
        return httpx.Response(200, json=payment_intent("succeeded"))

    transport = httpx.MockTransport(reply)
    stripe = StripeProvider(api_key="sk_test_x", transport=transport, async_transport=transport)

    async def both() -> tuple[Answer, Answer]:
        async with stripe:
            return stripe.query_status(query(reference=None)), await stripe.aquery_status(
                query(reference=None)
            )

    sync_answer, async_answer = asyncio.run(both())
    assert sync_answer == async_answer
    assert (async_answer.kind, async_answer.provider_reference) == (AnswerKind.SUCCEEDED, PI_ID)
    search, read = "/v1/payment_intents/search", f"/v1/payment_intents/{PI_ID}"
    assert calls == [search, read, search, read]
    assert OP_ID  # the operation the search looked for


def test_a_deadline_spent_waiting_for_a_connection_slot_is_not_sent() -> None:
    """One connection, held by a call at the provider: the other call never gets to write.

    Which call holds the connection is not left to the loop's scheduling: "a" has it, held
    at the sandbox (its deadline far off), before "b" starts with a short one.
    """

    async def main(sandbox: SandboxServer) -> tuple[Answer, Answer]:
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1))
        patient = httpx.Timeout(30.0)
        async with (
            SandboxProvider(
                base_url=sandbox.url,
                timeout=patient,
                deadline=timedelta(seconds=60),
                async_client=client,
            ) as holder,
            SandboxProvider(
                base_url=sandbox.url,
                timeout=httpx.Timeout(5.0),
                deadline=timedelta(seconds=0.5),
                async_client=client,
            ) as waiter,
        ):
            with sandbox.hold_commits() as gate:
                first = asyncio.create_task(holder.asubmit(_request("a")))
                assert await asyncio.to_thread(gate.wait_held, 1, 30)  # "a" is at the sandbox
                second = await waiter.asubmit(_request("b"))  # waits for the slot, in vain
                gate.release()
                held = await first
        await client.aclose()
        return held, second

    with SandboxServer() as sandbox:
        held, second = asyncio.run(main(sandbox))
        assert (second.kind, second.code) == (AnswerKind.NOT_SENT, DeadlineExceeded.code)
        assert held.kind is AnswerKind.SUCCEEDED  # the held call, answered once let go
        assert sandbox.effects_for("dk-b") == [] and len(sandbox.effects_for("dk-a")) == 1
        # The abandoned call never reached the sandbox, not even once the slot was free.
        posts = [r for r in sandbox.requests() if r["method"] == "POST"]
        assert [r["headers"]["idempotency-key"] for r in posts] == ["dk-a"]


def _request(operation_id: str) -> SubmitRequest:
    return SubmitRequest(
        tenant_id="shop",
        operation="payment.create",
        operation_id=operation_id,
        downstream_key=f"dk-{operation_id}",
        payload=PAYMENT,
    )


def test_the_async_reconciler_refuses_concurrent_checks(db_url: str) -> None:
    async def main() -> None:
        async with (
            SandboxProvider(
                base_url="http://127.0.0.1:9", timeout=FAST_TIMEOUT, deadline=timedelta(seconds=1)
            ) as provider,
            async_executor(db_url, provider, lease=timedelta(seconds=30)) as ex,
        ):
            with pytest.raises(ConfigurationError, match="one operation at a time"):
                AsyncReconciler(
                    store=ex.store,
                    providers=[provider],
                    policy=ReconcilerPolicy(lease=timedelta(seconds=30), concurrency=4),
                )

    asyncio.run(main())
