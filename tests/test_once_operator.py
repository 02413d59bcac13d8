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
    assert [i["id"] for i in json.loads(listed.output)["items"]] == [effect_id]
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
    assert json.loads(resolved.output)["result"] == {"entry": "e-1"}
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
