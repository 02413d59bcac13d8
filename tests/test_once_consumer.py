"""payorch.once.consumer and payorch.once.claim: inbound messages processed once in effect.

The consumer's handler counts what it did; 100 deliveries of one message at once make one
effect, on PostgreSQL and SQLite. No sleeps: the handler holds its run until every other
delivery has answered (so they all met it in flight), then lets it finish.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from test_once import Invalid, Refused, count_effects, expire_lease, stored

from payorch import once
from payorch.core import State
from payorch.errors import (
    CommitUncertain,
    ConfigurationError,
    EffectFailed,
    EffectOutcomeUnknown,
    IdempotencyKeyReused,
    InvalidIdempotencyKey,
    InvalidMessage,
    OperationInProgress,
)
from payorch.once import _flow, _sql
from payorch.storage._store import Store

DELIVERIES = 100


def test_a_hundred_concurrent_deliveries_make_one_effect(store: Store) -> None:
    effects: list[str] = []
    answered = threading.Semaphore(0)  # one release per delivery that came back
    start = threading.Barrier(DELIVERIES)

    @once.consumer(store, name="billing.invoices")
    def handle(message: once.InboundMessage) -> dict[str, Any]:
        effects.append(message.id)
        # Hold the run until the other 99 have their answer: all of them met it in flight.
        for _ in range(DELIVERIES - 1):
            assert answered.acquire(timeout=120), "a duplicate never answered"
        return {"invoice": message.payload["invoice"], "paid": True}

    def deliver(_: int) -> tuple[str, Any]:
        start.wait()
        try:
            result = handle.outcome({"id": "evt_1", "invoice": "in_7"})
            return ("result", result)
        except OperationInProgress as exc:
            answered.release()
            return ("in_progress", exc)

    with ThreadPoolExecutor(max_workers=DELIVERIES) as pool:
        answers = list(pool.map(deliver, range(DELIVERIES)))

    assert effects == ["evt_1"] and count_effects(store) == 1
    kinds = Counter(kind for kind, _ in answers)
    assert kinds == {"result": 1, "in_progress": DELIVERIES - 1}
    (ran,) = [value for kind, value in answers if kind == "result"]
    assert ran.value == {"invoice": "in_7", "paid": True} and not ran.replayed
    assert {exc.operation_id for kind, exc in answers if kind == "in_progress"} == {ran.effect_id}
    assert all(exc.retry_after >= 1 for kind, exc in answers if kind == "in_progress")

    # Redelivered once done: every delivery gets the stored result, nothing runs.
    start = threading.Barrier(DELIVERIES)

    def redeliver(_: int) -> once.EffectResult:
        start.wait()
        return handle.outcome({"id": "evt_1", "invoice": "in_7"})

    with ThreadPoolExecutor(max_workers=DELIVERIES) as pool:
        later = list(pool.map(redeliver, range(DELIVERIES)))
    assert all(r.replayed and r.value == ran.value for r in later)
    assert effects == ["evt_1"]


@dataclass
class OutboxLike:
    id: str
    payload: dict[str, Any]


def test_a_message_comes_in_any_of_its_usual_shapes(store: Store) -> None:
    seen: list[once.InboundMessage] = []

    @once.consumer(store, name="jobs")
    def handle(message: once.InboundMessage) -> Any:
        seen.append(message)
        return None if isinstance(message.payload, bytes) else message.payload

    assert handle(once.InboundMessage("m1", {"a": 1})) == {"a": 1}
    assert handle("m2", {"a": 2}) == {"a": 2}  # id and payload
    assert handle({"id": "m3", "a": 3}) == {"id": "m3", "a": 3}  # a webhook body
    assert handle(OutboxLike("m4", {"a": 4})) == {"a": 4}  # an outbox message
    assert handle(5, [1, 2]) == [1, 2]  # an integer id is its text
    assert handle("5", [1, 2]) == [1, 2]
    assert handle("m6", b"\x00raw bytes") is None  # bytes are fingerprinted, not stored
    assert [m.id for m in seen] == ["m1", "m2", "m3", "m4", "5", "m6"]
    assert count_effects(store) == 6


@pytest.mark.parametrize(
    "message",
    [
        {"invoice": "in_7"},
        {"id": None, "invoice": "in_7"},
        {"id": "", "invoice": "in_7"},
        once.InboundMessage("", {"invoice": "in_7"}),
        once.InboundMessage("has space"),
        once.InboundMessage("x" * 256),
        {"id": ["not", "an", "id"]},
        "just a string",
        object(),
    ],
)
def test_a_message_without_a_usable_id_is_refused_and_nothing_is_written(
    store: Store, message: object
) -> None:
    @once.consumer(store, name="hooks")
    def handle(message: once.InboundMessage) -> None:
        raise AssertionError("never runs")

    with pytest.raises(InvalidMessage) as info:
        handle(message)
    assert info.value.http_status == 400
    assert count_effects(store) == 0


def test_a_missing_id_says_why_it_matters(store: Store) -> None:
    @once.consumer(store, name="hooks")
    def handle(message: once.InboundMessage) -> None:
        raise AssertionError("never runs")

    with pytest.raises(InvalidMessage, match="has no id"):
        handle({"type": "invoice.paid"})


def test_the_same_id_with_another_payload_runs_nothing(store: Store) -> None:
    runs: list[Any] = []

    @once.consumer(store, name="hooks")
    def handle(message: once.InboundMessage) -> None:
        runs.append(message.payload)

    handle("evt_1", {"amount": 100})
    with pytest.raises(IdempotencyKeyReused) as info:
        handle("evt_1", {"amount": 999})
    assert info.value.http_status == 422
    assert runs == [{"amount": 100}]
    # Metadata is transport, never the effect: a redelivery with new headers is a replay.
    again = handle.outcome(once.InboundMessage("evt_1", {"amount": 100}, {"delivery": 2}))
    assert again.replayed and runs == [{"amount": 100}]


def test_a_payload_with_no_canonical_form_is_an_invalid_message(store: Store) -> None:
    @once.consumer(store, name="hooks")
    def handle(message: once.InboundMessage) -> None:
        raise AssertionError("never runs")

    for payload in ({"x": float("inf")}, {"x": {1, 2}}, {"x": "\ud800"}, {"x": object()}):
        with pytest.raises(InvalidMessage):
            handle("evt_1", payload)
    assert count_effects(store) == 0


def test_a_consumer_classifies_its_handlers_exceptions(store: Store) -> None:
    runs: list[str] = []

    @once.consumer(store, name="hooks", retry_on=Refused, final_on=Invalid)
    def handle(message: once.InboundMessage) -> str:
        runs.append(message.id)
        kind = message.payload["kind"]
        if kind == "refused" and runs.count(message.id) == 1:
            raise Refused("downstream unavailable")
        if kind == "invalid":
            raise Invalid("no such account")
        if kind == "timeout":
            raise TimeoutError("no answer")
        return "ok"

    with pytest.raises(Refused):  # the delivery loop nacks: the broker redelivers
        handle("m1", {"kind": "refused"})
    assert handle("m1", {"kind": "refused"}) == "ok"
    for _ in range(2):
        with pytest.raises(EffectFailed) as failed:  # ack (or dead-letter): final
            handle("m2", {"kind": "invalid"})
        assert failed.value.error_type == "Invalid"
    for _ in range(2):
        with pytest.raises(EffectOutcomeUnknown):  # ack: an operator has it
            handle("m3", {"kind": "timeout"})
    assert runs == ["m1", "m1", "m2", "m3"]


def test_the_tenant_can_come_from_the_message(store: Store) -> None:
    @once.consumer(store, name="hooks", tenant=lambda m: m.metadata["tenant"])
    def handle(message: once.InboundMessage) -> str:
        return once.current().tenant_id

    assert handle(once.InboundMessage("m", {}, {"tenant": "t1"})) == "t1"
    assert handle(once.InboundMessage("m", {}, {"tenant": "t2"})) == "t2"
    with pytest.raises(InvalidMessage):
        handle(once.InboundMessage("m", {}, {"tenant": "bad tenant"}))
    assert stored(store, "hooks", "m", tenant="t2").state is State.SUCCEEDED


# -- the context manager -----------------------------------------------------------------


def test_claim_runs_a_block_once_and_replays_its_result(store: Store) -> None:
    posted: list[str] = []

    def post(entry: str) -> Any:
        with once.claim(store, "ledger.post", entry, {"amount": 5}) as effect:
            if effect.replayed:
                return effect.result
            assert once.current() == effect.effect
            posted.append(effect.downstream_key)
            effect.succeed({"entry": entry, "attempt": effect.attempt})
        return effect.result

    assert post("e1") == {"entry": "e1", "attempt": 1}
    assert post("e1") == {"entry": "e1", "attempt": 1}
    assert len(posted) == 1 and posted[0].endswith(":effect")
    with pytest.raises(IdempotencyKeyReused), once.claim(store, "ledger.post", "e1", {"amount": 6}):
        raise AssertionError("never runs")


def test_a_block_that_ends_normally_succeeded_with_no_result(store: Store) -> None:
    with once.claim(store, "n", "k1") as effect:
        assert not effect.replayed
    assert stored(store, "n", "k1").state is State.SUCCEEDED
    with once.claim(store, "n", "k1") as effect:
        assert effect.replayed and effect.result is None
        with pytest.raises(ConfigurationError):
            effect.succeed("again")  # a replay does not run


def test_a_blocks_exception_means_what_it_means_for_a_function(store: Store) -> None:
    with pytest.raises(EffectFailed), once.claim(store, "n", "final", final_on=Invalid):
        raise Invalid("bad account")
    with pytest.raises(Refused), once.claim(store, "n", "retry", retry_on=Refused):
        raise Refused("try later")
    with pytest.raises(EffectOutcomeUnknown), once.claim(store, "n", "unknown"):
        raise TimeoutError("no answer")
    assert stored(store, "n", "final").state is State.FAILED_FINAL
    assert stored(store, "n", "retry").released
    assert stored(store, "n", "unknown").needs_attention
    # After succeed() the effect is done: a later exception goes on, the result is kept.
    with pytest.raises(KeyError), once.claim(store, "n", "done") as effect:
        effect.succeed({"ok": 1})
        raise KeyError("after the effect")
    assert stored(store, "n", "done").result == {"ok": 1}


def test_a_claim_is_entered_once_and_checked_first(store: Store) -> None:
    claimed = once.claim(store, "n", "k")
    with claimed:
        pass
    with pytest.raises(ConfigurationError), claimed:
        pass
    with pytest.raises(InvalidIdempotencyKey):
        once.claim(store, "n", "bad key")
    with pytest.raises(ConfigurationError):
        _ = once.claim(store, "n", "k2").effect  # not entered yet
    assert count_effects(store) == 1


def test_a_claim_whose_commit_was_in_doubt_holds_the_key_until_its_lease_lapses(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    posted: list[str] = []
    lost: list[bool] = []

    def answer_lost(real: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            done = real(*args, **kwargs)  # the claim commits; its answer never comes back
            if not lost:
                lost.append(True)
                raise CommitUncertain("connection lost during COMMIT")
            return done

        return run

    for name in ("run_statement", "run_in_transaction"):
        monkeypatch.setattr(_sql, name, answer_lost(getattr(_sql, name)))

    def post(entry: str) -> Any:
        with once.claim(store, "ledger.post", entry) as effect:
            if not effect.replayed:
                posted.append(effect.downstream_key)
                effect.succeed({"entry": entry})
        return effect.result

    with pytest.raises(CommitUncertain) as info:
        post("e1")
    record = stored(store, "ledger.post", "e1")  # it did commit, unmarked, leased to us
    assert info.value.operation_id == record.id and not record.possibly_sent
    with pytest.raises(OperationInProgress):  # not taken over while that lease is live
        post("e1")
    expire_lease(store, "ledger.post", "e1")
    assert post("e1") == {"entry": "e1"} and post("e1") == {"entry": "e1"}
    assert len(posted) == 1 and not stored(store, "ledger.post", "e1").needs_attention


# -- a late answer is answered by what is stored --------------------------------------------


def test_a_delivery_that_outran_its_lease_gets_what_the_redelivery_stored(store: Store) -> None:
    runs: list[bool] = []

    @once.consumer(store, name="hooks", rerun_safe=True)
    def handle(message: once.InboundMessage) -> str:
        runs.append(once.current().rerun)
        if len(runs) == 1:
            # Outruns its lease: the redelivery takes it over and runs it again.
            expire_lease(store, "hooks", message.id)
            rerun = handle.outcome(message)
            assert (rerun.value, rerun.replayed) == ("second run", False)
            return "first run"
        return "second run"

    first = handle.outcome("m1", {"n": 1})
    assert (first.value, first.replayed) == ("second run", True)  # what is stored, as stored
    assert stored(store, "hooks", "m1").result == "second run" and runs == [False, True]
    assert handle("m1", {"n": 1}) == "second run" and len(runs) == 2


def test_a_late_answer_while_a_rerun_holds_the_key_is_in_progress(store: Store) -> None:
    runs: list[str] = []
    holder: list[_flow.Running] = []

    @once.consumer(store, name="hooks", rerun_safe=True)
    def handle(message: once.InboundMessage) -> str:
        runs.append(message.id)
        # Outruns its lease; a redelivery takes it over and is still running it.
        expire_lease(store, "hooks", message.id)
        taken = _flow.start(store, handle.policy, handle._messages.target(message))
        assert isinstance(taken, _flow.Running) and taken.effect.rerun
        holder.append(taken)
        return "first run"

    with pytest.raises(OperationInProgress):  # not "first run": that is not what is stored
        handle("m1", {"n": 1})
    _flow.finish(store, holder[0], "second run")
    assert handle("m1", {"n": 1}) == "second run" and runs == ["m1"]


def test_a_block_that_failed_late_gets_the_result_stored_meanwhile(store: Store) -> None:
    blocks: list[bool] = []

    def post(entry: str) -> Any:
        with once.claim(store, "ledger.post", entry, rerun_safe=True, final_on=Invalid) as effect:
            if effect.replayed:
                return effect.result
            blocks.append(effect.rerun)
            if len(blocks) == 1:
                # Outruns its lease; a retry takes it over and posts it.
                expire_lease(store, "ledger.post", entry)
                assert post(entry) == {"entry": entry, "by": "retry"}
                raise Invalid("refused")  # late, and not what the key holds
            effect.succeed({"entry": entry, "by": "retry"})
        return effect.result

    assert post("e1") == {"entry": "e1", "by": "retry"}  # not EffectFailed
    assert stored(store, "ledger.post", "e1").state is State.SUCCEEDED
    assert blocks == [False, True]
