"""The operator CLI's ops commands (list, show, resolve, recheck) on real databases holding
operations in every state.

Stats, durations, the reconciler's commands and the CLI as a real process are in
test_cli_runtime.py, ``effects unexplained`` in test_cli_effects.py; what they share in
cli_helpers.py.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from cli_helpers import (
    LIVE,
    REGISTRY,
    World,
    ids,
    listed,
    make_world,
    one_error_line,
    run,
    snapshot,
    to_unknown,
)
from conftest import effects_of

from payorch.cli import _render as render
from payorch.core import State
from payorch.provider import AnswerKind, SubmitRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.records import OperationRecord
from payorch.storage._store import Store

# Fields that travel as ISO 8601 text in JSON.
TIMES = {n for n, f in OperationRecord.__dataclass_fields__.items() if "datetime" in str(f.type)}


@pytest.fixture
def world(store: Store) -> World:
    return make_world(store)


# -- ops list ----------------------------------------------------------------------------


def test_list_filters(db_url: str, world: World) -> None:
    assert ids(listed(db_url)) == {r.id for r in world.all()}
    assert ids(listed(db_url, "--state", "outcome_unknown")) == {world.unknown.id, world.flagged.id}
    assert ids(listed(db_url, "--state", "in_progress")) == {world.live.id, world.abandoned.id}
    assert ids(listed(db_url, "--tenant", "shop-b")) == {world.flagged.id, world.failed.id}
    assert ids(listed(db_url, "--operation", "payout.create")) == {world.flagged.id}
    assert ids(listed(db_url, "--provider", "stripe")) == {world.flagged.id}
    assert ids(listed(db_url, "--needs-attention")) == {world.flagged.id}
    assert ids(listed(db_url, "--tenant", "shop-a", "--state", "succeeded")) == {world.succeeded.id}
    assert listed(db_url, "--older-than", "1d") == []
    assert ids(listed(db_url, "--older-than", "0s")) == {r.id for r in world.all()}


def test_list_is_newest_first_and_pages_with_a_cursor(db_url: str, world: World) -> None:
    everything = [i["id"] for i in listed(db_url)]
    created = {r.id: r.created_at for r in world.all()}
    assert everything == sorted(everything, key=lambda i: (created[i], i), reverse=True)
    seen: list[str] = []
    args = ["--limit", "4"]
    for _ in range(3):
        page = json.loads(run(db_url, "ops", "list", "--json", *args).stdout)
        seen += [i["id"] for i in page["items"]]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        args = ["--limit", "4", "--after", page["next_cursor"]]
    assert seen == everything


def test_json_round_trips_what_the_table_shows(db_url: str, store: Store, world: World) -> None:
    payload = json.loads(run(db_url, "ops", "list", "--json").stdout)
    now = datetime.fromisoformat(payload["now"])
    table = run(db_url, "ops", "list")
    assert table.exit_code == 0
    lines = table.stdout.splitlines()
    for item in payload["items"]:
        values = {
            k: datetime.fromisoformat(v) if k in TIMES and v is not None else v
            for k, v in item.items()
            if k != "age_seconds"
        }
        record = OperationRecord.from_row(values)
        assert record == store.get(record.tenant_id, record.id)  # every field survives JSON
        assert item["age_seconds"] == pytest.approx((now - record.created_at).total_seconds())
        (line,) = [line for line in lines if record.id in line]
        cells = render.operation_row(record, now)
        for column in ("tenant", "operation", "state", "amount", "provider ref", "checks"):
            assert cells[column] in line, (column, line)
        assert line.lstrip().startswith("!") == record.needs_attention
    assert "50.00 JPY" not in table.stdout and "5,000 JPY" in table.stdout
    assert "19.99 EUR" in table.stdout and "eff_ok" in table.stdout


def test_list_finds_an_operation_by_provider_reference_or_key(db_url: str, world: World) -> None:
    ref = world.succeeded.provider_reference
    assert ref is not None
    assert ids(listed(db_url, "--reference", ref)) == {world.succeeded.id}
    key = world.unknown.idempotency_key
    assert ids(listed(db_url, "--key", key, "--tenant", world.unknown.tenant_id)) == {
        world.unknown.id
    }
    assert listed(db_url, "--reference", "pi_nobody") == []
    bad = run(db_url, "ops", "list", "--tenant", "bad tenant")
    assert bad.exit_code == 1 and "tenant id" in bad.stderr


# -- ops show ----------------------------------------------------------------------------


def test_show_prints_the_timeline_with_actor_evidence_and_durations(
    db_url: str, world: World
) -> None:
    result = run(db_url, "ops", "show", world.unknown.id)
    assert result.exit_code == 0, result.output
    text = result.stdout
    for expected in (
        world.unknown.id,
        world.unknown.downstream_key,
        "claimed",
        "provider_answer",
        "worker-1",
        "in_progress -> outcome_unknown",
        "12.5 ms",
        "code=http_500",
        "19.99 EUR",
    ):
        assert expected in text, expected
    by_key = run(
        db_url, "ops show --tenant shop-a --operation payment.create --key k-unknown --json"
    )
    shown = json.loads(by_key.stdout)
    assert shown["operation"]["id"] == world.unknown.id
    assert [e["kind"] for e in shown["events"]] == ["claimed", "provider_answer"]
    assert shown["events"][1]["detail"]["duration_ms"] == 12.5
    assert shown["events"][1]["actor"] == "worker-1"


def test_show_needs_an_id_or_a_whole_namespace(db_url: str, world: World) -> None:
    assert run(db_url, "ops", "show").exit_code == 2
    assert run(db_url, "ops", "show", "--tenant", "shop-a", "--key", "k-ok").exit_code == 2
    missing = run(db_url, "ops", "show", "0190-not-there")
    assert missing.exit_code == 1
    assert "no operation 0190-not-there" in one_error_line(missing)


# -- ops resolve -------------------------------------------------------------------------


def test_resolve_writes_one_audit_event_and_refuses_a_second(
    db_url: str, store: Store, world: World
) -> None:
    op = world.flagged
    result = run(
        db_url,
        f"ops resolve {op.id} --as succeeded --reason 'seen in dashboard' --actor alice "
        "--provider-reference pi_123 --yes",
    )
    assert result.exit_code == 0, result.output
    after = store.get(op.tenant_id, op.id)
    assert after.state is State.SUCCEEDED
    assert (after.resolution, after.provider_reference, after.needs_attention) == (
        "operator",
        "pi_123",
        False,
    )
    assert after.response is not None and after.response["http_status"] == 200
    audit = [e for e in store.events(op.tenant_id, op.id) if e.kind == "operator_resolution"]
    assert len(audit) == 1
    assert audit[0].actor == "alice"
    assert audit[0].detail is not None and audit[0].detail["reason"] == "seen in dashboard"
    assert (audit[0].from_state, audit[0].to_state) == ("outcome_unknown", "succeeded")
    assert audit[0].id in result.stdout

    before = snapshot(store)
    again = run(db_url, f"ops resolve {op.id} --as failed_final --reason oops --actor bob --yes")
    assert again.exit_code == 1
    assert "terminal" in one_error_line(again)
    assert snapshot(store) == before


def test_resolve_asks_first_and_a_no_changes_nothing(
    db_url: str, store: Store, world: World
) -> None:
    op = world.abandoned  # in_progress, lease expired, nothing sent
    args = ["ops", "resolve", op.id, "--as", "failed_final", "--reason", "never sent"]
    before = snapshot(store)
    no = run(db_url, *args, "--actor", "alice", input="n\n")
    assert no.exit_code == 1
    assert "aborted" in no.stderr
    assert snapshot(store) == before
    eof = run(db_url, *args, "--actor", "alice", input="")
    assert eof.exit_code == 1
    assert snapshot(store) == before
    yes = run(db_url, *args, "--actor", "alice", input="y\n")
    assert yes.exit_code == 0, yes.output
    assert store.get(op.tenant_id, op.id).state is State.FAILED_FINAL


def test_resolve_refuses_an_operation_with_a_live_lease(
    db_url: str, store: Store, world: World
) -> None:
    before = snapshot(store)
    cmd = f"ops resolve {world.live.id} --as succeeded --reason r --actor alice --yes"
    result = run(db_url, cmd)
    assert result.exit_code == 1
    assert "leased by worker-1" in one_error_line(result)
    assert snapshot(store) == before


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--as", "succeeded", "--actor", "alice"], 2),  # no reason
        (["--as", "succeeded", "--reason", "r"], 2),  # no actor
        (["--as", "succeeded", "--reason", "  ", "--actor", "alice"], 2),  # blank reason
        (["--as", "in_progress", "--reason", "r", "--actor", "alice"], 2),  # not a final state
        (["--reason", "r", "--actor", "alice"], 2),  # no --as
    ],
)
def test_resolve_bad_input_changes_nothing(
    db_url: str, store: Store, world: World, args: list[str], code: int
) -> None:
    before = snapshot(store)
    result = run(db_url, "ops", "resolve", world.unknown.id, *args, "--yes")
    assert result.exit_code == code
    one_error_line(result)
    assert snapshot(store) == before


def test_resolve_unknown_id_is_refused(db_url: str, world: World) -> None:
    result = run(db_url, "ops resolve nope --as succeeded --reason r --actor a --yes")
    assert result.exit_code == 1
    assert "no operation nope" in one_error_line(result)


# -- ops recheck -------------------------------------------------------------------------


def test_recheck_resolves_a_sandbox_backed_unknown(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    prepared = REGISTRY.prepare(
        tenant_id="shop-a",
        operation="payment.create",
        idempotency_key="k-lost-answer",
        request={"amount": 4200, "currency": "EUR", "customer": "cus_9"},
    )
    record = store.claim(prepared.new, owner="worker-1", lease=LIVE, possibly_sent=True).operation
    # The provider took the payment, but the answer never reached us.
    answer = sandbox_provider.submit(
        SubmitRequest(
            tenant_id=record.tenant_id,
            operation=record.operation,
            operation_id=record.id,
            downstream_key=record.downstream_key,
            payload=prepared.payload,
            idempotency_key=record.idempotency_key,
            fingerprint=record.fingerprint,
        )
    )
    assert answer.kind is AnswerKind.SUCCEEDED
    unknown = to_unknown(store, record)
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}

    result = run(db_url, "ops", "recheck", unknown.id, "--actor", "alice", "--json", env=env)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["from_state"], report["outcome"]) == ("outcome_unknown", "succeeded")
    after = store.get(record.tenant_id, record.id)
    assert after.state is State.SUCCEEDED
    assert after.provider_reference == answer.provider_reference
    assert [e["kind"] for e in report["events"]] == ["operator_recheck", "status_query"]
    assert report["events"][1]["actor"] == "operator:alice"
    assert len(effects_of(sandbox, store, record.tenant_id, record.id)) == 1

    again = run(db_url, "ops", "recheck", unknown.id, env=env)
    assert again.exit_code == 1
    assert "terminal" in one_error_line(again)
    assert len(effects_of(sandbox, store, record.tenant_id, record.id)) == 1


def test_recheck_refuses_a_live_lease(db_url: str, store: Store, world: World) -> None:
    before = snapshot(store)
    result = run(db_url, "ops", "recheck", world.live.id)
    assert result.exit_code == 1
    assert "leased by" in one_error_line(result)
    assert snapshot(store) == before
