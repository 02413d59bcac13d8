"""The operator's side of payorch.once (list, resolve, the CLI) and its HTTP answers."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from test_once import Crash, Invalid, count_effects, expire_lease, stored
from typer.testing import CliRunner

from payorch import once
from payorch.cli._once import once_app
from payorch.core import State
from payorch.errors import (
    CommitUncertain,
    ConfigurationError,
    CorruptRecord,
    EffectFailed,
    EffectOutcomeUnknown,
    IdempotencyKeyReused,
    InvalidMessage,
    InvalidRequest,
    InvalidTransition,
    OperationInProgress,
    OperationNotFound,
    StaleVersion,
    UnencodableRequest,
)
from payorch.http import OPERATION_HEADER, PROBLEM_JSON, REPLAYED_HEADER
from payorch.once import _metrics
from payorch.storage._store import Store
from payorch.storage._tables import effects

runner = CliRunner()


def _escalate(store: Store, key: str, *, namespace: str = "ledger.post", tenant: str = "t1") -> str:
    @once.idempotent(store, namespace=namespace, key="k", tenant=tenant)
    def post(k: str) -> None:
        raise TimeoutError("no answer")

    with pytest.raises(EffectOutcomeUnknown) as info:
        post(key)
    return info.value.effect_id


def _again(store: Store, key: str, *, namespace: str = "ledger.post", tenant: str = "t1") -> Any:
    @once.idempotent(store, namespace=namespace, key="k", tenant=tenant)
    def post(k: str) -> None:
        raise AssertionError("a resolved effect never runs again")

    return post(key)


def test_escalated_effects_are_listed_oldest_first_and_filtered(store: Store) -> None:
    ids = [_escalate(store, "a"), _escalate(store, "b", namespace="email"), _escalate(store, "c")]
    _escalate(store, "d", tenant="t2")
    assert [r.id for r in once.escalated(store, tenant_id="t1")] == ids
    assert [r.key for r in once.escalated(store, namespace="email")] == ["b"]
    assert len(once.escalated(store)) == 4
    assert [r.key for r in once.escalated(store, limit=1)] == ["a"]
    with pytest.raises(InvalidRequest):
        once.escalated(store, limit=0)


def test_resolving_as_succeeded_is_what_later_calls_replay(store: Store) -> None:
    effect_id = _escalate(store, "a")
    done = once.resolve(
        store,
        effect_id,
        to="succeeded",
        result={"entry": "e-9"},
        actor="ana",
        reason="found in the ledger's export",
    )
    assert done.state is State.SUCCEEDED and not done.needs_attention
    assert done.error is not None and done.error["resolution"]["actor"] == "ana"
    assert done.error["previous"]["type"] == "TimeoutError"  # what was known before stays
    assert _again(store, "a") == {"entry": "e-9"}
    assert once.escalated(store) == []
    with pytest.raises(InvalidTransition):  # settled effects are not rewritten
        once.resolve(store, effect_id, to="failed_final", actor="ana", reason="oops")


def test_resolving_as_failed_replays_an_effect_failure(store: Store) -> None:
    effect_id = _escalate(store, "a")
    once.resolve(
        store, effect_id, to=State.FAILED_FINAL, actor="ana", reason="never reached the ledger"
    )
    for _ in range(2):
        with pytest.raises(EffectFailed) as info:
            _again(store, "a")
        assert info.value.error_type == "OperatorResolution"
        assert info.value.error_message == "never reached the ledger"


def test_resolve_respects_a_live_lease_and_the_version_read(store: Store) -> None:
    @once.idempotent(store, namespace="jobs", key="k")
    def job(k: str) -> None:
        raise Crash

    with pytest.raises(Crash):
        job("j1")
    running = stored(store, "jobs", "j1")
    with pytest.raises(OperationInProgress):  # its worker may still be at it
        once.resolve(store, running.id, to="succeeded", actor="ana", reason="looked")
    expire_lease(store, "jobs", "j1")
    with pytest.raises(StaleVersion):
        once.resolve(
            store,
            running.id,
            to="succeeded",
            actor="ana",
            reason="looked",
            expected_version=running.version - 1,
        )
    done = once.resolve(store, running.id, to="succeeded", actor="ana", reason="it ran")
    assert done.state is State.SUCCEEDED and done.error is not None
    assert done.error["resolution"]["from"] == "in_progress"


def test_resolve_refuses_what_is_not_a_decision(store: Store) -> None:
    effect_id = _escalate(store, "a")
    for bad in ({"actor": " "}, {"reason": ""}, {"to": "in_progress"}):
        args: dict[str, Any] = {"to": "succeeded", "actor": "ana", "reason": "r", **bad}
        with pytest.raises(InvalidRequest):
            once.resolve(store, effect_id, **args)
    with pytest.raises(UnencodableRequest):
        once.resolve(store, effect_id, to="succeeded", actor="a", reason="r", result=object())
    with pytest.raises(OperationNotFound):
        once.resolve(
            store, "01a00000-0000-7000-8000-000000000000", to="succeeded", actor="a", reason="r"
        )
    assert stored(store, "ledger.post", "a", tenant="t1").needs_attention


def test_find_and_get(store: Store) -> None:
    effect_id = _escalate(store, "a")
    assert once.find(store, effect_id).key == "a"
    assert once.find(store, effect_id, tenant_id="t1").id == effect_id
    with pytest.raises(OperationNotFound):
        once.find(store, effect_id, tenant_id="t2")
    with pytest.raises(OperationNotFound):
        once.get(store, tenant_id="t1", namespace="ledger.post", key="zz")
    record = once.get(store, tenant_id="t1", namespace="ledger.post", key="a")
    assert record.to_dict()["state"] == "outcome_unknown"
    assert json.dumps(record.to_dict())  # JSON-ready


# -- the CLI --------------------------------------------------------------------------------


def test_the_cli_lists_shows_and_resolves(db_url: str, store: Store) -> None:
    effect_id = _escalate(store, "a")
    listed = runner.invoke(once_app, ["list", "--database-url", db_url, "--json"])
    assert listed.exit_code == 0, listed.output
    assert [i["id"] for i in json.loads(listed.stdout)["items"]] == [effect_id]
    shown = runner.invoke(once_app, ["show", effect_id, "--database-url", db_url])
    assert shown.exit_code == 0 and effect_id in shown.output and "TimeoutError" in shown.output
    refused = runner.invoke(
        once_app,
        ["resolve", effect_id, "--as", "succeeded", "--reason", "r", "--database-url", db_url],
        input="n\n",
    )
    assert refused.exit_code == 1 and stored(store, "ledger.post", "a", tenant="t1").needs_attention
    resolved = runner.invoke(
        once_app,
        [
            "resolve",
            effect_id,
            "--as",
            "succeeded",
            "--result",
            '{"entry": "e-1"}',
            "--reason",
            "in the export",
            "--actor",
            "ana",
            "--yes",
            "--database-url",
            db_url,
            "--json",
        ],
    )
    assert resolved.exit_code == 0, resolved.output
    assert json.loads(resolved.stdout)["result"] == {"entry": "e-1"}
    assert _again(store, "a") == {"entry": "e-1"}
    empty = runner.invoke(once_app, ["list", "--database-url", db_url])
    assert empty.exit_code == 0 and "no escalated effects" in empty.output
    bad = runner.invoke(
        once_app,
        ["resolve", effect_id, "--as", "succeeded", "--result", "{", "--reason", "r", "--yes"],
    )
    assert bad.exit_code == 2


# -- HTTP ------------------------------------------------------------------------------------


def test_effect_answers_follow_the_payment_mapping(store: Store) -> None:
    @once.consumer(store, name="hooks", final_on=Invalid)
    def handle(message: once.InboundMessage) -> Any:
        if message.payload.get("bad"):
            raise Invalid("no such account")
        if message.payload.get("slow"):
            raise TimeoutError("no answer")
        return {"ok": True}

    fresh = once.effect_answer(handle.outcome({"id": "m1"}))
    replay = once.effect_answer(handle.outcome({"id": "m1"}))
    assert (fresh.status, fresh.body["result"]) == (200, {"ok": True})
    assert REPLAYED_HEADER not in fresh.headers and replay.headers[REPLAYED_HEADER] == "true"
    assert fresh.headers[OPERATION_HEADER] == fresh.body["effect_id"]

    def answer(message: dict[str, Any]) -> Any:
        try:
            handle(message)
        except Exception as exc:
            return once.effect_answer(exc)  # type: ignore[arg-type]
        raise AssertionError("should have raised")

    failed = answer({"id": "m2", "bad": True})
    assert (failed.status, failed.content_type, failed.body["error_type"]) == (
        422,
        PROBLEM_JSON,
        "Invalid",
    )
    unknown = answer({"id": "m3", "slow": True})
    assert unknown.status == 202 and unknown.headers["Retry-After"] == "60"
    assert unknown.body["retry"] == "same_key"
    assert answer({"id": "m1", "other": 1}).status == 422  # reused
    assert answer({"no": "id"}).status == 400
    in_flight = once.effect_answer(OperationInProgress("busy", operation_id="e", retry_after=2.0))
    assert (in_flight.status, in_flight.headers["Retry-After"]) == (409, "2")
    uncertain = once.effect_answer(CommitUncertain("lost", operation_id="e"))
    assert uncertain.status == 503 and uncertain.body["retry"] == "same_key"
    assert isinstance(InvalidMessage("x"), InvalidRequest)
    assert IdempotencyKeyReused.http_status == 422
    assert count_effects(store) == 3


def test_a_corrupt_row_is_a_storage_error_not_a_new_run(store: Store) -> None:
    effect_id = _escalate(store, "a")
    with store.engine.begin() as conn:
        conn.execute(sa.update(effects).where(effects.c.id == effect_id).values(state="bogus"))
    with pytest.raises(CorruptRecord) as info:
        _again(store, "a")
    assert info.value.http_status == 503 and info.value.operation_id == effect_id
    assert count_effects(store) == 1


# -- what rerun_safe may take over -----------------------------------------------------------


def test_rerun_safe_never_reruns_an_effect_whose_result_could_not_be_stored(store: Store) -> None:
    runs: list[str] = []

    @once.idempotent(store, namespace="email", key="k", rerun_safe=True)
    def send(k: str) -> object:
        runs.append(k)
        return object() if len(runs) == 1 else "sent again"

    with pytest.raises(ConfigurationError):  # it ran, and its result has no JSON form
        send("k1")
    for _ in range(2):  # it ran: never again, rerun_safe or not, until an operator says
        with pytest.raises(EffectOutcomeUnknown):
            send("k1")
    record = stored(store, "email", "k1")
    assert record.needs_attention and record.error is not None
    assert record.error["kind"] == "unencodable_result" and runs == ["k1"]
    once.resolve(store, record.id, to="succeeded", result={"id": "m-1"}, actor="a", reason="log")
    assert send("k1") == {"id": "m-1"} and runs == ["k1"]


@pytest.mark.parametrize("escalation", ["possibly_sent", "lease_expired"])
def test_rerun_safe_takes_over_an_effect_escalated_as_possibly_sent(
    store: Store, escalation: str
) -> None:
    runs: list[tuple[str, bool]] = []

    @once.idempotent(store, namespace="email", key="k")
    def cautious(k: str) -> None:
        runs.append(("cautious", once.current().rerun))
        raise TimeoutError("no answer") if escalation == "possibly_sent" else Crash

    @once.idempotent(store, namespace="email", key="k", rerun_safe=True)
    def safe(k: str) -> str:
        runs.append(("safe", once.current().rerun))
        return "sent"

    with pytest.raises((EffectOutcomeUnknown, Crash)):
        cautious("k1")
    if escalation == "lease_expired":
        expire_lease(store, "email", "k1")
        with pytest.raises(EffectOutcomeUnknown):
            cautious("k1")
    escalated = stored(store, "email", "k1")
    assert escalated.error is not None and escalated.error["kind"] == escalation
    assert safe("k1") == "sent" and safe("k1") == "sent"  # the provider dedupes on our key
    assert runs == [("cautious", False), ("safe", True)]
    assert not stored(store, "email", "k1").needs_attention


# -- a late answer is answered by what is stored ------------------------------------------------


@pytest.mark.parametrize(
    ("run_ends", "decision", "expected"),
    [
        ("returns", "failed_final", EffectFailed),
        ("returns", "succeeded", {"entry": "by-operator"}),
        ("raises_final", "succeeded", {"entry": "by-operator"}),
        ("raises_unknown", "succeeded", {"entry": "by-operator"}),
        ("raises_unknown", "failed_final", EffectFailed),
    ],
)
def test_a_run_that_outran_its_lease_answers_what_the_operator_decided(
    store: Store, monkeypatch: pytest.MonkeyPatch, run_ends: str, decision: str, expected: Any
) -> None:
    runs: list[str] = []
    answered: list[str] = []
    monkeypatch.setattr(_metrics, "counted", lambda namespace, result: answered.append(result))

    @once.idempotent(store, namespace="ledger.post", key="k", final_on=Invalid)
    def post(k: str) -> dict[str, str]:
        runs.append(k)
        # The call outruns its lease: a duplicate escalates it, an operator settles it.
        expire_lease(store, "ledger.post", k)
        with pytest.raises(EffectOutcomeUnknown) as info:
            post(k)
        result = {"entry": "by-operator"} if decision == "succeeded" else None
        once.resolve(store, info.value.effect_id, to=decision, result=result, actor="a", reason="r")
        answered.clear()  # what the late run itself answers, from here
        if run_ends == "raises_final":
            raise Invalid("refused")
        if run_ends == "raises_unknown":
            raise TimeoutError("no answer")
        return {"entry": "by-the-run"}

    if expected is EffectFailed:
        with pytest.raises(EffectFailed) as failed:
            post("k1")
        assert failed.value.error_type == "OperatorResolution" and answered == ["failed_replayed"]
    else:
        got = post.outcome("k1")
        assert (got.value, got.replayed) == (expected, True) and answered == ["replayed"]
    assert runs == ["k1"]  # the duplicate ran nothing
    record = stored(store, "ledger.post", "k1")
    assert record.state is State(decision) and record.error is not None
    assert record.error["resolution"]["actor"] == "a"  # the operator's decision stands
