"""payorch.once's async forms: coroutine functions and handlers, ``async with``, on an
AsyncStore (psycopg's async driver, aiosqlite). They run the sync flow under the greenlet
bridge, so these tests check that the same rules hold there, and that the event loop
is never blocked by a duplicate that waits.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import pytest
from test_once import Crash, Invalid, Refused, count_effects, expire_lease, stored

from payorch import once
from payorch.core import State
from payorch.errors import (
    ConfigurationError,
    EffectFailed,
    EffectOutcomeUnknown,
    IdempotencyKeyReused,
    InvalidMessage,
    OperationInProgress,
)
from payorch.once import _flow
from payorch.storage._async_store import AsyncStore
from payorch.storage._store import Store

T = TypeVar("T")
DELIVERIES = 100


def run(db_url: str, test: Callable[[AsyncStore], Awaitable[T]]) -> T:
    """``test`` on a fresh event loop with an AsyncStore of its own, closed after."""

    async def main() -> T:
        async with AsyncStore.from_url(db_url) as astore:
            return await test(astore)

    return asyncio.run(main())


def test_a_hundred_concurrent_tasks_deliver_one_message_once(db_url: str, store: Store) -> None:
    effects: list[str] = []

    async def test(astore: AsyncStore) -> list[tuple[str, Any]]:
        others_answered = asyncio.Event()
        answered = 0

        @once.consumer(astore, name="billing.invoices")
        async def handle(message: once.InboundMessage) -> dict[str, Any]:
            effects.append(message.id)
            # Held until the other 99 have their answer: each met this run in flight.
            await asyncio.wait_for(others_answered.wait(), 120)
            return {"invoice": message.payload["invoice"]}

        async def deliver() -> tuple[str, Any]:
            nonlocal answered
            try:
                return ("result", await handle.outcome({"id": "evt_1", "invoice": "in_7"}))
            except OperationInProgress as exc:
                answered += 1
                if answered == DELIVERIES - 1:
                    others_answered.set()
                return ("in_progress", exc)

        first = await asyncio.gather(*(deliver() for _ in range(DELIVERIES)))
        later = await asyncio.gather(
            *(handle.outcome({"id": "evt_1", "invoice": "in_7"}) for _ in range(DELIVERIES))
        )
        return [*first, *(("replay", r) for r in later)]

    answers = run(db_url, test)
    assert effects == ["evt_1"] and count_effects(store) == 1
    kinds = Counter(kind for kind, _ in answers)
    assert kinds == {"result": 1, "in_progress": DELIVERIES - 1, "replay": DELIVERIES}
    (ran,) = [value for kind, value in answers if kind == "result"]
    assert ran.value == {"invoice": "in_7"} and not ran.replayed
    assert all(r.replayed and r.value == ran.value for kind, r in answers if kind == "replay")


def test_an_async_function_runs_once_and_knows_its_effect(db_url: str, store: Store) -> None:
    seen: list[once.Effect] = []

    async def test(astore: AsyncStore) -> list[Any]:
        @once.idempotent(astore, namespace="email.receipt", key="order_id")
        async def send(order_id: str, to: str) -> dict[str, str]:
            await asyncio.sleep(0)  # a real await inside the effect
            seen.append(once.current())
            return {"to": to}

        first = await send.outcome("o-1", "a@example.com")
        again = await send.outcome("o-1", "a@example.com")
        value = await send("o-1", "a@example.com")
        with pytest.raises(IdempotencyKeyReused):
            await send("o-1", "b@example.com")
        return [first, again, value]

    first, again, value = run(db_url, test)
    assert (first.replayed, again.replayed) == (False, True)
    assert first.value == again.value == value == {"to": "a@example.com"}
    assert len(seen) == 1 and seen[0].id == first.effect_id
    assert send_key(seen[0]) == seen[0].downstream_key


def send_key(effect: once.Effect) -> str:
    from payorch.once._values import effect_downstream_key

    return effect_downstream_key(effect.tenant_id, effect.namespace, effect.key)


def test_async_exceptions_mean_what_they_mean_for_sync_ones(db_url: str, store: Store) -> None:
    runs: list[str] = []

    async def test(astore: AsyncStore) -> None:
        @once.idempotent(astore, namespace="n", key="k", retry_on=Refused, final_on=Invalid)
        async def act(k: str) -> str:
            runs.append(k)
            if k == "retry" and runs.count(k) == 1:
                raise Refused("later")
            if k == "final":
                raise Invalid("never")
            if k == "unknown":
                raise TimeoutError("maybe")
            return "ok"

        with pytest.raises(Refused):
            await act("retry")
        assert await act("retry") == "ok"
        for _ in range(2):
            with pytest.raises(EffectFailed):
                await act("final")
            with pytest.raises(EffectOutcomeUnknown):
                await act("unknown")

    run(db_url, test)
    assert runs == ["retry", "retry", "final", "unknown"]
    assert stored(store, "n", "unknown").needs_attention


def test_an_async_crash_reruns_only_when_rerun_safe(db_url: str, store: Store) -> None:
    keys: list[str] = []

    async def test(astore: AsyncStore) -> Any:
        @once.idempotent(astore, namespace="email", key="k", rerun_safe=True)
        async def send(k: str) -> str:
            keys.append(once.current().downstream_key)
            if len(keys) == 1:
                raise Crash
            return "sent"

        with pytest.raises(Crash):
            await send("k1")
        with pytest.raises(OperationInProgress):
            await send("k1")
        expire_lease(store, "email", "k1")
        return await send("k1")

    assert run(db_url, test) == "sent"
    assert len(keys) == 2 and keys[0] == keys[1]


def test_async_with_claims_and_replays(db_url: str, store: Store) -> None:
    posted: list[str] = []

    async def test(astore: AsyncStore) -> list[Any]:
        async def post(entry: str) -> Any:
            async with once.claim(astore, "ledger.post", entry, {"n": 1}) as effect:
                if effect.replayed:
                    return effect.result
                assert once.current().id == effect.id
                posted.append(effect.downstream_key)
                effect.succeed({"entry": entry})
            return effect.result

        results = [await post("e1"), await post("e1")]
        with pytest.raises(EffectFailed):
            async with once.claim(astore, "ledger.post", "e2", final_on=Invalid):
                raise Invalid("closed account")
        # A sync block needs a sync Store.
        with pytest.raises(ConfigurationError), once.claim(astore, "ledger.post", "e3"):
            pass
        return results

    assert run(db_url, test) == [{"entry": "e1"}, {"entry": "e1"}]
    assert len(posted) == 1
    assert stored(store, "ledger.post", "e2").state is State.FAILED_FINAL


def test_an_async_duplicate_waits_for_the_run_in_flight(
    db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    naps: list[float] = []
    real_pause = _flow.pause

    async def test(astore: AsyncStore) -> list[Any]:
        started, waiting = asyncio.Event(), asyncio.Event()

        def pause(seconds: float) -> None:
            naps.append(seconds)
            waiting.set()  # the duplicate waits: the run in flight may finish
            real_pause(seconds)  # bridged: an asyncio.sleep on this loop

        monkeypatch.setattr(_flow, "pause", pause)

        @once.consumer(astore, name="jobs", wait=timedelta(seconds=60))
        async def handle(message: once.InboundMessage) -> str:
            started.set()
            await asyncio.wait_for(waiting.wait(), 60)
            return "done"

        first = asyncio.create_task(handle.outcome("job-1", {}))
        await started.wait()
        duplicate = await handle.outcome("job-1", {})
        return [await first, duplicate]

    first, duplicate = run(db_url, test)
    assert (first.value, first.replayed) == ("done", False)
    assert (duplicate.value, duplicate.replayed) == ("done", True) and naps


def test_async_forms_refuse_a_sync_store_and_bad_messages(db_url: str, store: Store) -> None:
    async def handler(message: once.InboundMessage) -> None:
        return None

    with pytest.raises(ConfigurationError):
        once.consumer(store, name="jobs")(handler)

    async def test(astore: AsyncStore) -> None:
        with pytest.raises(ConfigurationError):  # a sync handler needs a sync Store
            once.consumer(astore, name="jobs")(lambda m: None)
        consume = once.consumer(astore, name="jobs")(handler)
        with pytest.raises(InvalidMessage):
            await consume({"no": "id"})
        with pytest.raises(ConfigurationError):
            async with once.claim(store, "n", "k"):
                pass

    run(db_url, test)
    assert count_effects(store) == 0
