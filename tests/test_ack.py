"""Acknowledging a flagged terminal operation: the attention queue can be worked to empty."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner, Result

from payorch.cli._app import app
from payorch.core import State
from payorch.errors import (
    InvalidRequest,
    InvalidTransition,
    OperationNotFound,
    PayorchError,
    StaleVersion,
)
from payorch.operations import default_registry
from payorch.reconciling import _operator as operator
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

REGISTRY = default_registry("sandbox")
runner = CliRunner()


def claim(store: Store, key: str, tenant: str = "shop") -> OperationRecord:
    prepared = REGISTRY.prepare(
        tenant_id=tenant,
        operation="payment.create",
        idempotency_key=key,
        request={"amount": 1999, "currency": "EUR", "customer": "cus_1"},
    )
    return store.claim(prepared.new, owner="worker-1", lease=timedelta(minutes=5)).operation


def succeeded(store: Store, key: str, tenant: str = "shop") -> OperationRecord:
    return store.transition(
        claim(store, key, tenant),
        State.SUCCEEDED,
        kind="provider_answer",
        actor="worker-1",
        provider_reference=f"eff_{key}",
        response={"status": "succeeded", "http_status": 200},
    )


def conflicted(store: Store, record: OperationRecord) -> OperationRecord:
    """Flag ``record`` as the webhook handler does when a second final word contradicts it."""
    return store.flag_attention(
        record,
        kind="conflicting_evidence",
        actor="webhook",
        detail={"event_id": "evt_1", "outcome": "declined", "conflicts_with": "succeeded"},
    )


def unknown_flagged(store: Store, key: str) -> OperationRecord:
    return store.transition(
        claim(store, key),
        State.OUTCOME_UNKNOWN,
        kind="provider_answer",
        actor="worker-1",
        next_check_in=timedelta(minutes=1),
        needs_attention=True,
    )


def snapshot(store: Store) -> tuple[list[Any], int]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(operations).order_by(operations.c.id)).all()
        count = conn.execute(sa.select(sa.func.count()).select_from(events)).scalar_one()
    return [tuple(r) for r in rows], int(count)


def run(db_url: str, *args: str, input: str | None = None) -> Result:
    return runner.invoke(app, [*args, "--database-url", db_url], input=input)


def attention_queue(db_url: str) -> list[str]:
    result = run(db_url, "ops", "list", "--needs-attention", "--json")
    assert result.exit_code == 0, result.output
    return [item["id"] for item in json.loads(result.stdout)["items"]]


def one_error_line(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    assert lines[0].startswith("error: ")
    return lines[0]


# -- the library -------------------------------------------------------------------------


def test_ack_clears_the_flag_keeps_the_state_and_audits(store: Store) -> None:
    flagged = conflicted(store, succeeded(store, "k1"))
    other = conflicted(store, succeeded(store, "k2", tenant="other"))
    assert flagged.needs_attention

    after = operator.acknowledge(
        store, None, flagged.id, reason="duplicate refunded by hand", actor="alice"
    )

    assert (after.state, after.needs_attention, after.version) == (
        State.SUCCEEDED,
        False,
        flagged.version + 1,
    )
    assert (after.response, after.provider_reference, after.error_code) == (
        flagged.response,
        flagged.provider_reference,
        flagged.error_code,
    )
    timeline = store.events(flagged.tenant_id, flagged.id)
    assert [e.kind for e in timeline][-2:] == ["conflicting_evidence", "acknowledged"]
    ack = timeline[-1]
    assert ack.actor == "alice"
    assert (ack.from_state, ack.to_state) == (None, None)
    assert ack.detail == {
        "reason": "duplicate refunded by hand",
        "state": "succeeded",
        "version": flagged.version,
    }
    assert store.get(other.tenant_id, other.id).needs_attention  # only the one named


def test_a_stale_version_is_refused_and_changes_nothing(store: Store) -> None:
    shown = conflicted(store, succeeded(store, "k1"))
    # New evidence lands after the operator looked: the flag is raised again.
    conflicted(store, shown)
    before = snapshot(store)
    with pytest.raises(StaleVersion, match="look again"):
        operator.acknowledge(
            store,
            shown.tenant_id,
            shown.id,
            reason="seen",
            actor="alice",
            expected_version=shown.version,
        )
    assert snapshot(store) == before


def test_a_concurrent_write_between_read_and_update_is_refused(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    flagged = conflicted(store, succeeded(store, "k1"))
    real_load = operator.load

    def load_then_race(*args: Any) -> Any:
        loaded = real_load(*args)
        conflicted(store, flagged)  # another writer moves the version on
        return loaded

    monkeypatch.setattr(operator, "load", load_then_race)
    with pytest.raises(StaleVersion):
        operator.acknowledge(store, None, flagged.id, reason="seen", actor="alice")
    after = store.get(flagged.tenant_id, flagged.id)
    assert after.needs_attention
    assert "acknowledged" not in [e.kind for e in store.events(after.tenant_id, after.id)]


@pytest.mark.parametrize(
    ("setup", "kwargs", "error", "match"),
    [
        ("plain", {}, InvalidTransition, "not flagged"),
        ("unknown", {}, InvalidTransition, "ops resolve"),
        ("flagged", {"reason": "   "}, InvalidRequest, "non-empty reason"),
        ("flagged", {"actor": ""}, InvalidRequest, "non-empty actor"),
        ("flagged", {"reason": "r" * 2001}, InvalidRequest, "longer than 2000"),
        ("flagged", {"actor": "a" * 201}, InvalidRequest, "longer than 200"),
        ("missing", {}, OperationNotFound, "no operation"),
    ],
)
def test_refusals_change_nothing(
    store: Store, setup: str, kwargs: dict[str, str], error: type[PayorchError], match: str
) -> None:
    records = {
        "plain": succeeded(store, "k-plain"),
        "unknown": unknown_flagged(store, "k-unknown"),
        "flagged": conflicted(store, succeeded(store, "k-flagged")),
    }
    target = records[setup].id if setup in records else "0190-not-there"
    args = {"reason": "seen", "actor": "alice"} | kwargs
    before = snapshot(store)
    with pytest.raises(error, match=match):
        operator.acknowledge(store, None, target, **args)
    assert snapshot(store) == before


def test_a_second_ack_is_refused(store: Store) -> None:
    flagged = conflicted(store, succeeded(store, "k1"))
    operator.acknowledge(store, None, flagged.id, reason="seen", actor="alice")
    before = snapshot(store)
    with pytest.raises(InvalidTransition, match="not flagged"):
        operator.acknowledge(store, None, flagged.id, reason="seen again", actor="bob")
    assert snapshot(store) == before


# -- the CLI -----------------------------------------------------------------------------


def test_ops_ack_works_the_queue_to_empty(db_url: str, store: Store) -> None:
    first = conflicted(store, succeeded(store, "k1"))
    second = conflicted(store, succeeded(store, "k2", tenant="other"))
    assert sorted(attention_queue(db_url)) == sorted([first.id, second.id])

    result = run(
        db_url, "ops", "ack", first.id, "--reason", "refunded by hand", "--actor", "alice", "--yes"
    )
    assert result.exit_code == 0, result.output
    ack = store.events(first.tenant_id, first.id)[-1]
    assert ack.kind == "acknowledged"
    assert ack.id in result.stdout
    assert "state stays succeeded" in result.stdout

    result = run(
        db_url,
        "ops",
        "ack",
        second.id,
        "--tenant",
        "other",
        "--reason",
        "customer confirmed",
        "--actor",
        "bob",
        "--yes",
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["operation"]["needs_attention"] is False
    assert report["operation"]["state"] == "succeeded"
    assert (report["event"]["kind"], report["event"]["actor"]) == ("acknowledged", "bob")
    assert report["event"]["detail"]["reason"] == "customer confirmed"

    assert attention_queue(db_url) == []
    shown = run(db_url, "ops", "show", second.id, "--json")
    timeline = json.loads(shown.stdout)["events"]
    assert [e["kind"] for e in timeline][-1] == "acknowledged"


def test_ops_ack_asks_first_and_a_no_changes_nothing(db_url: str, store: Store) -> None:
    flagged = conflicted(store, succeeded(store, "k1"))
    args = ["ops", "ack", flagged.id, "--reason", "seen", "--actor", "alice"]
    before = snapshot(store)
    no = run(db_url, *args, input="n\n")
    assert no.exit_code == 1
    assert "aborted: nothing changed" in no.stderr
    assert snapshot(store) == before
    eof = run(db_url, *args, input="")
    assert eof.exit_code == 1
    assert snapshot(store) == before

    yes = run(db_url, *args, "--json", input="y\n")
    assert yes.exit_code == 0, yes.output
    # The prompt goes to stderr; the test runner echoes the typed answer onto stdout itself.
    document = yes.stdout[yes.stdout.index("{") :]
    assert json.loads(document)["operation"]["needs_attention"] is False
    assert "Acknowledge on behalf of alice" in yes.stderr


@pytest.mark.parametrize(
    ("target", "args", "code", "message"),
    [
        ("plain", ["--reason", "r", "--actor", "a"], 1, "not flagged"),
        ("unknown", ["--reason", "r", "--actor", "a"], 1, "ops resolve"),
        ("missing", ["--reason", "r", "--actor", "a"], 1, "no operation"),
        ("flagged", ["--reason", "r" * 2001, "--actor", "a"], 1, "longer than 2000"),
        ("flagged", ["--reason", "  ", "--actor", "a"], 2, "must not be empty"),
        ("flagged", ["--actor", "a"], 2, "--reason"),
        ("flagged", ["--reason", "r"], 2, "--actor"),
    ],
)
def test_ops_ack_refusals_are_one_line_and_change_nothing(
    db_url: str, store: Store, target: str, args: list[str], code: int, message: str
) -> None:
    records = {
        "plain": succeeded(store, "k-plain"),
        "unknown": unknown_flagged(store, "k-unknown"),
        "flagged": conflicted(store, succeeded(store, "k-flagged")),
    }
    ident = records[target].id if target in records else "0190-not-there"
    before = snapshot(store)
    result = run(db_url, "ops", "ack", ident, *args, "--yes")
    assert result.exit_code == code, result.output
    if code == 1:
        assert message in one_error_line(result)
    else:
        assert message in result.output
    assert snapshot(store) == before
