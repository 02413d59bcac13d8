"""payorch.once.idempotent: any side effect once, on PostgreSQL and SQLite.

Every test counts effects: each wrapped function appends to a list what it did (and under
which downstream key). Crashes are simulated, never waited for: a worker "killed" mid-call
raises a BaseException (nothing is written after it, as after kill -9), and a lapsed lease
is made by moving its expiry into the past on the database clock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from payorch import once
from payorch.core import State
from payorch.errors import (
    ConfigurationError,
    EffectFailed,
    EffectOutcomeUnknown,
    IdempotencyKeyReused,
    InvalidIdempotencyKey,
    InvalidTenant,
    OperationInProgress,
    OutcomeNotRecorded,
    StorageError,
    UnencodableRequest,
)
from payorch.once import _flow, _sql, _values
from payorch.storage._store import Store
from payorch.storage._tables import db_now_plus, effects


class Crash(BaseException):
    """kill -9 in the middle of the call: the wrapper writes nothing after it."""


class Refused(Exception):
    """The downstream system refused before doing anything (retry_on)."""


class Invalid(Exception):
    """The downstream system refused for good (final_on)."""


# -- helpers shared by the test_once_* modules --------------------------------------------


def expire_lease(store: Store, namespace: str, key: str, tenant: str = "default") -> None:
    """Let the lease lapse, by the database clock (a crashed worker's, or an outrun one)."""
    c = effects.c
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(effects)
            .where(c.tenant_id == tenant, c.namespace == namespace, c.key == key)
            .values(lease_expires_at=db_now_plus(-3600.0))
        )


def count_effects(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar_one())


def stored(store: Store, namespace: str, key: str, tenant: str = "default") -> once.EffectRecord:
    return once.get(store, tenant_id=tenant, namespace=namespace, key=key)


@pytest.fixture
def ledger() -> list[tuple[str, Any]]:
    """What the wrapped functions did: (downstream key, what)."""
    return []


# -- the happy path --------------------------------------------------------------------


def test_first_call_runs_and_every_later_one_replays(
    store: Store, ledger: list[tuple[str, Any]]
) -> None:
    @once.idempotent(store, namespace="email.receipt", key="order_id")
    def send(order_id: str, to: str) -> Any:
        ledger.append((once.current().downstream_key, to))
        return {"to": to, "lines": ("a", "b")}

    first = send.outcome("o-1", "a@example.com")
    again = send.outcome("o-1", "a@example.com")
    assert send("o-1", "a@example.com") == {"to": "a@example.com", "lines": ["a", "b"]}
    # The first caller gets what replays get: JSON's form (the tuple is a list).
    assert first.value == again.value == {"to": "a@example.com", "lines": ["a", "b"]}
    assert (first.replayed, again.replayed) == (False, True)
    assert first.effect_id == again.effect_id and first.attempts == 1
    assert len(ledger) == 1 and count_effects(store) == 1
    record = stored(store, "email.receipt", "o-1")
    assert record.state is State.SUCCEEDED and record.result == first.value
    assert record.lease_owner is None and record.completed_at is not None
    assert record.retain_until is not None and record.retain_until > record.completed_at
    assert send.__name__ == "send"  # the wrapper keeps the function's identity


def test_the_downstream_key_comes_from_the_namespace_only(store: Store) -> None:
    seen: list[once.Effect] = []

    @once.idempotent(store, namespace="ledger.post", key="key", tenant=lambda key, t: t)
    def post(key: str, t: str) -> None:
        seen.append(once.current())

    post("k", "t1")
    post("k", "t2")
    post("k2", "t1")
    keys = [e.downstream_key for e in seen]
    assert keys[0] == _values.effect_downstream_key("t1", "ledger.post", "k")
    assert len(set(keys)) == 3 and all(e.id not in e.downstream_key for e in seen)
    assert keys[0].startswith("payorch:") and keys[0].endswith(":effect")
    assert [e.attempt for e in seen] == [1, 1, 1] and not any(e.rerun for e in seen)
    with pytest.raises(ConfigurationError):
        once.current()  # only while an effect runs


def test_a_key_reused_with_other_arguments_runs_nothing(
    store: Store, ledger: list[tuple[str, Any]]
) -> None:
    @once.idempotent(store, namespace="email.receipt", key="order_id")
    def send(order_id: str, to: str) -> None:
        ledger.append(("", to))

    send("o-1", "a@example.com")
    with pytest.raises(IdempotencyKeyReused) as info:
        send("o-1", "b@example.com")
    assert info.value.http_status == 422
    assert info.value.operation_id == stored(store, "email.receipt", "o-1").id
    assert ledger == [("", "a@example.com")]


def test_a_fingerprint_function_leaves_transport_arguments_out(store: Store) -> None:
    calls: list[int] = []

    @once.idempotent(
        store,
        namespace="ledger.post",
        key=lambda entry, client: entry["id"],
        fingerprint=lambda entry, client: entry,
    )
    def post(entry: dict[str, Any], client: object) -> int:
        calls.append(entry["amount"])
        return len(calls)

    assert post({"id": "e1", "amount": 5}, object()) == 1
    assert post({"amount": 5, "id": "e1"}, object()) == 1  # key order does not matter
    with pytest.raises(IdempotencyKeyReused):
        post({"id": "e1", "amount": 6}, object())
    assert calls == [5]


def test_tenants_keep_their_own_effects(store: Store, ledger: list[tuple[str, Any]]) -> None:
    @once.idempotent(store, namespace="n", key="k", tenant=lambda k, tenant: tenant)
    def act(k: str, tenant: str) -> str:
        ledger.append((once.current().downstream_key, tenant))
        return tenant

    assert [act("same", "t1"), act("same", "t2"), act("same", "t1")] == ["t1", "t2", "t1"]
    assert [t for _, t in ledger] == ["t1", "t2"] and ledger[0][0] != ledger[1][0]
    with pytest.raises(InvalidTenant):
        act("same", "not a tenant")
    assert count_effects(store) == 2


# -- what an exception means -------------------------------------------------------------


def test_retry_on_releases_the_claim_and_the_same_key_runs_again(store: Store) -> None:
    runs: list[once.Effect] = []

    @once.idempotent(store, namespace="sms", key="k", retry_on=Refused)
    def text(k: str) -> str:
        runs.append(once.current())
        if len(runs) == 1:
            raise Refused("connection refused")
        return "sent"

    with pytest.raises(Refused):  # the caller's own exception: nothing happened
        text("k1")
    released = stored(store, "sms", "k1")
    assert released.state is State.IN_PROGRESS and released.released
    assert not released.possibly_sent and released.error is not None
    assert released.error["kind"] == "retry" and released.error["type"] == "Refused"
    assert text("k1") == "sent"
    assert [(r.attempt, r.rerun) for r in runs] == [(1, False), (2, False)]
    assert runs[0].downstream_key == runs[1].downstream_key and runs[0].id == runs[1].id
    assert text("k1") == "sent" and len(runs) == 2


def test_final_on_is_recorded_and_replayed_identically(store: Store) -> None:
    runs: list[str] = []

    @once.idempotent(store, namespace="email", key="k", final_on=(Invalid,))
    def send(k: str) -> None:
        runs.append(k)
        raise Invalid("mailbox does not exist")

    errors = []
    for _ in range(3):
        with pytest.raises(EffectFailed) as info:
            send("k1")
        errors.append(info.value)
    assert runs == ["k1"]
    assert {(e.error_type, e.error_message, e.message, e.http_status) for e in errors} == {
        ("Invalid", "mailbox does not exist", errors[0].message, 422)
    }
    assert isinstance(errors[0].__cause__, Invalid)  # the first one says where it came from
    record = stored(store, "email", "k1")
    assert record.state is State.FAILED_FINAL and not record.needs_attention
    assert errors[0].effect_id == record.id


def test_the_most_specific_exception_class_decides(store: Store) -> None:
    @once.idempotent(
        store, namespace="files", key="k", retry_on=OSError, final_on=FileNotFoundError
    )
    def read(k: str) -> None:
        raise FileNotFoundError(k) if k == "missing" else ConnectionRefusedError(k)

    with pytest.raises(EffectFailed):
        read("missing")
    with pytest.raises(ConnectionRefusedError):
        read("refused")
    assert stored(store, "files", "missing").state is State.FAILED_FINAL
    assert stored(store, "files", "refused").released


def test_any_other_exception_escalates_and_never_runs_again(store: Store) -> None:
    runs: list[str] = []

    @once.idempotent(store, namespace="ledger.post", key="k")
    def post(k: str) -> None:
        runs.append(k)
        raise TimeoutError("read timed out")  # it may have been posted

    for _ in range(3):
        with pytest.raises(EffectOutcomeUnknown) as info:
            post("k1")
        assert info.value.http_status == 202
    assert runs == ["k1"]
    record = stored(store, "ledger.post", "k1")
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert record.possibly_sent and record.lease_expires_at is None
    assert record.error == {
        "kind": "possibly_sent",
        "type": "TimeoutError",
        "message": "read timed out",
    }
    assert [r.id for r in once.escalated(store)] == [record.id]


def test_rerun_safe_runs_again_under_the_same_downstream_key(
    store: Store, ledger: list[tuple[str, Any]]
) -> None:
    @once.idempotent(store, namespace="email", key="k", rerun_safe=True)
    def send(k: str) -> str:
        effect = once.current()
        ledger.append((effect.downstream_key, (effect.attempt, effect.rerun)))
        if effect.attempt == 1:
            raise TimeoutError("read timed out")  # sent? the provider dedupes on our key
        return "sent"

    with pytest.raises(TimeoutError):  # goes through: the same key will run again
        send("k1")
    between = stored(store, "email", "k1")
    assert between.released and between.possibly_sent and not between.needs_attention
    assert send("k1") == "sent" and send("k1") == "sent"
    assert [what for _, what in ledger] == [(1, False), (2, True)]
    assert len({key for key, _ in ledger}) == 1


# -- crashes: a lease that lapsed ----------------------------------------------------------


def test_a_crash_mid_call_holds_the_key_then_escalates(
    store: Store, ledger: list[tuple[str, Any]]
) -> None:
    @once.idempotent(store, namespace="ledger.post", key="k")
    def post(k: str) -> str:
        ledger.append(("", k))
        if len(ledger) == 1:
            raise Crash
        return "posted"

    with pytest.raises(Crash):
        post("k1")
    with pytest.raises(OperationInProgress) as info:  # its lease still runs
        post("k1")
    assert info.value.http_status == 409 and 1 <= info.value.retry_after <= 5
    expire_lease(store, "ledger.post", "k1")
    with pytest.raises(EffectOutcomeUnknown):  # it may have been posted: for an operator
        post("k1")
    with pytest.raises(EffectOutcomeUnknown):
        post("k1")
    assert ledger == [("", "k1")]
    record = stored(store, "ledger.post", "k1")
    assert record.needs_attention and record.error is not None
    assert record.error["kind"] == "lease_expired"


def test_a_crash_mid_call_runs_again_when_rerun_safe(
    store: Store, ledger: list[tuple[str, Any]]
) -> None:
    @once.idempotent(store, namespace="email", key="k", rerun_safe=True)
    def send(k: str) -> str:
        ledger.append((once.current().downstream_key, once.current().rerun))
        if len(ledger) == 1:
            raise Crash
        return "sent"

    with pytest.raises(Crash):
        send("k1")
    with pytest.raises(OperationInProgress):
        send("k1")
    expire_lease(store, "email", "k1")
    assert send("k1") == "sent" and send("k1") == "sent"
    assert [rerun for _, rerun in ledger] == [False, True]
    assert ledger[0][0] == ledger[1][0]
    assert not stored(store, "email", "k1").needs_attention


def test_a_worker_that_died_before_the_call_is_taken_over(store: Store) -> None:
    runs: list[once.Effect] = []

    @once.idempotent(store, namespace="email", key="k")
    def send(k: str) -> str:
        runs.append(once.current())
        return "sent"

    # Claimed, and killed before it marked the run possibly sent: nothing went out.
    policy = send.policy
    digest = send._arguments.target(("k1",), {}).fingerprint
    target = _values.Target(tenant_id="default", key="k1", fingerprint=digest)
    record, _, created = _sql.claim_row(store, policy, target)
    assert created and not record.possibly_sent
    with pytest.raises(OperationInProgress):
        send("k1")
    expire_lease(store, "email", "k1")
    assert send("k1") == "sent"
    assert len(runs) == 1 and runs[0].id == record.id and not runs[0].rerun
    assert not stored(store, "email", "k1").needs_attention


def test_an_answer_after_the_lease_was_lost_settles_the_escalation(store: Store) -> None:
    outcomes: list[BaseException] = []

    @once.idempotent(store, namespace="ledger.post", key="k")
    def post(k: str) -> dict[str, str]:
        # The call outruns its lease; meanwhile a duplicate escalates it.
        expire_lease(store, "ledger.post", k)
        with pytest.raises(EffectOutcomeUnknown) as info:
            post(k)
        outcomes.append(info.value)
        return {"entry": "e-1"}

    assert post("k1") == {"entry": "e-1"}  # our answer is evidence of what happened
    assert len(outcomes) == 1
    record = stored(store, "ledger.post", "k1")
    assert record.state is State.SUCCEEDED and not record.needs_attention
    assert record.result == {"entry": "e-1"} and record.error is not None
    assert record.error["late"] is True and record.error["previous"]["kind"] == "lease_expired"
    assert post.outcome("k1").replayed


# -- what cannot be stored ------------------------------------------------------------------


def test_a_result_json_cannot_hold_is_escalated_not_lost(store: Store) -> None:
    runs: list[str] = []

    @once.idempotent(store, namespace="email", key="k")
    def send(k: str) -> object:
        runs.append(k)
        return object()

    with pytest.raises(ConfigurationError) as info:
        send("k1")
    assert "ran" in info.value.message and "JSON" in info.value.message
    record = stored(store, "email", "k1")  # it ran: that fact is kept
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert record.error is not None and record.error["kind"] == "unencodable_result"
    with pytest.raises(EffectOutcomeUnknown):
        send("k1")
    assert runs == ["k1"]


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, None, 1.5, "caf\u00e9"])
def test_a_bad_key_is_refused_and_nothing_is_written(store: Store, key: object) -> None:
    @once.idempotent(store, namespace="n", key="k")
    def act(k: object) -> None:
        raise AssertionError("never runs")

    with pytest.raises(InvalidIdempotencyKey) as info:
        act(key)
    assert info.value.http_status == 400
    assert count_effects(store) == 0


def test_arguments_with_no_json_form_are_refused_before_the_claim(store: Store) -> None:
    @once.idempotent(store, namespace="n", key="k")
    def act(k: str, client: object) -> None:
        raise AssertionError("never runs")

    with pytest.raises(UnencodableRequest) as info:
        act("k1", object())
    assert "fingerprint=" in info.value.message
    with pytest.raises(UnencodableRequest):
        act("k1", float("nan"))
    assert count_effects(store) == 0


def test_a_misconfigured_decorator_is_refused_when_it_is_built(store: Store) -> None:
    with pytest.raises(ConfigurationError):
        once.idempotent(store, namespace="has space", key="k")
    with pytest.raises(ConfigurationError):
        once.idempotent(store, namespace="n", key="k", lease=timedelta(0))
    with pytest.raises(ConfigurationError):
        once.idempotent(store, namespace="n", key="k", retry_on=KeyError, final_on=KeyError)
    with pytest.raises(ConfigurationError):
        once.idempotent(store, namespace="n", key="k", retry_on="KeyError")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        once.idempotent("sqlite://", namespace="n", key="k")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        once.idempotent(store, namespace="n", key="nope")(lambda k: None)

    async def coroutine(k: str) -> None:
        return None

    with pytest.raises(ConfigurationError):  # an async function needs an AsyncStore
        once.idempotent(store, namespace="n", key="k")(coroutine)


def test_a_store_factory_is_resolved_on_first_use(store: Store) -> None:
    made: list[Store] = []

    def factory() -> Store:
        made.append(store)
        return store

    @once.idempotent(factory, namespace="n", key="k")
    def act(k: str) -> str:
        return k

    assert made == []  # decorating opened nothing
    assert act("a") == "a" and made == [store]


# -- storage failures ----------------------------------------------------------------------


@pytest.fixture
def table_away(store: Store) -> Iterator[Any]:
    """Make payorch_effects vanish (and come back): every statement on it fails."""

    def rename(frm: str, to: str) -> None:
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {frm} RENAME TO {to}")

    gone = {"away": False}

    def away() -> None:
        rename("payorch_effects", "payorch_effects_away")
        gone["away"] = True

    def back() -> None:
        if gone["away"]:
            rename("payorch_effects_away", "payorch_effects")
            gone["away"] = False

    yield type("Table", (), {"away": staticmethod(away), "back": staticmethod(back)})
    back()


def test_storage_failing_before_the_claim_runs_nothing(store: Store, table_away: Any) -> None:
    runs: list[str] = []

    @once.idempotent(store, namespace="n", key="k")
    def act(k: str) -> None:
        runs.append(k)

    table_away.away()
    with pytest.raises(StorageError) as info:
        act("k1")
    assert info.value.http_status == 503 and not isinstance(info.value, OutcomeNotRecorded)
    table_away.back()
    act("k1")
    assert runs == ["k1"]


def test_storage_failing_after_the_effect_says_so_and_never_runs_it_twice(
    store: Store, table_away: Any
) -> None:
    runs: list[str] = []

    @once.idempotent(store, namespace="n", key="k")
    def act(k: str) -> str:
        runs.append(k)
        table_away.away()  # the database goes before the outcome is written
        return "done"

    with pytest.raises(OutcomeNotRecorded) as info:
        act("k1")
    assert info.value.http_status == 503  # "retry the same key later"
    table_away.back()
    record = stored(store, "n", "k1")
    assert info.value.operation_id == record.id and record.possibly_sent
    with pytest.raises(OperationInProgress):
        act("k1")
    expire_lease(store, "n", "k1")
    with pytest.raises(EffectOutcomeUnknown):  # it ran; nobody knows that but the log
        act("k1")
    assert runs == ["k1"]


# -- waiting, metrics -------------------------------------------------------------------------


def test_a_bounded_wait_answers_with_the_run_it_waited_for(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    runs: list[str] = []

    @once.idempotent(store, namespace="n", key="k", wait=timedelta(seconds=60))
    def act(k: str) -> str:
        runs.append(k)
        assert release.wait(60), "the waiter never waited"
        return "done"

    naps: list[float] = []
    real_pause = _flow.pause

    def pause(seconds: float) -> None:
        naps.append(seconds)
        release.set()  # the duplicate is waiting: let the first run finish
        real_pause(seconds)

    monkeypatch.setattr(_flow, "pause", pause)
    results: list[once.EffectResult] = []
    other = threading.Thread(target=lambda: results.append(act.outcome("k1")))
    other.start()
    # Either call may be the one that runs: it finishes only once the other waits (the
    # pause hook), so the other always waited for a run in flight.
    results.append(act.outcome("k1"))
    other.join(60)
    assert runs == ["k1"] and [r.value for r in results] == ["done", "done"]
    assert sorted(r.replayed for r in results) == [False, True] and naps
    assert act.outcome("k1").replayed


def test_effects_are_counted_by_namespace_and_answer(store: Store) -> None:
    pytest.importorskip("prometheus_client")
    from payorch import metrics

    assert metrics.registry is not None

    def sample(result: str) -> float:
        labels = {"namespace": "metered", "result": result}
        return metrics.registry.get_sample_value("payorch_effects_total", labels) or 0.0  # type: ignore[union-attr]

    before = {r: sample(r) for r in ("fresh", "replayed", "key_reused")}

    @once.idempotent(store, namespace="metered", key="k")
    def act(k: str, v: int) -> int:
        return v

    act("k1", 1)
    act("k1", 1)
    act("k1", 1)
    with pytest.raises(IdempotencyKeyReused):
        act("k1", 2)
    after = {r: sample(r) - before[r] for r in before}
    assert after == {"fresh": 1.0, "replayed": 2.0, "key_reused": 1.0}
