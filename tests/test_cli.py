"""The operator CLI on real databases holding operations in every state."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from conftest import effects_of
from typer.testing import CliRunner, Result

from payorch.cli import _render as render
from payorch.cli._app import app
from payorch.cli._runtime import parse_duration
from payorch.core import State, namespace_ref
from payorch.errors import ProviderUnavailable
from payorch.execution._executor import Executor, RetryPolicy
from payorch.operations import default_registry
from payorch.provider import AnswerKind, SubmitRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.sandbox._faults import Fault
from payorch.records import OperationRecord
from payorch.storage._queries import stats
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

LIVE = timedelta(minutes=5)
REGISTRY = default_registry("sandbox")
PAYORCH = Path(sys.executable).with_name("payorch")
runner = CliRunner()
# Fields that travel as ISO 8601 text in JSON.
TIMES = {n for n, f in OperationRecord.__dataclass_fields__.items() if "datetime" in str(f.type)}


def claim(
    store: Store,
    key: str,
    *,
    tenant: str = "shop-a",
    operation: str = "payment.create",
    provider: str = "sandbox",
    lease: timedelta = LIVE,
    possibly_sent: bool = True,
    request: dict[str, Any] | None = None,
) -> OperationRecord:
    prepared = REGISTRY.prepare(
        tenant_id=tenant,
        operation=operation,
        idempotency_key=key,
        request=request or {"amount": 1999, "currency": "EUR", "customer": "cus_1"},
        provider=provider,
    )
    res = store.claim(prepared.new, owner="worker-1", lease=lease, possibly_sent=possibly_sent)
    return res.operation


def to_unknown(
    store: Store, record: OperationRecord, *, attention: bool = False
) -> OperationRecord:
    return store.transition(
        record,
        State.OUTCOME_UNKNOWN,
        kind="provider_answer",
        actor="worker-1",
        detail={"attempt": 1, "duration_ms": 12.5, "kind": "ambiguous", "code": "http_500"},
        next_check_in=timedelta(minutes=10),
        error_code="http_500",
        needs_attention=attention,
    )


@dataclass
class World:
    live: OperationRecord
    abandoned: OperationRecord
    unknown: OperationRecord
    flagged: OperationRecord
    succeeded: OperationRecord
    failed: OperationRecord

    def all(self) -> list[OperationRecord]:
        return [self.live, self.abandoned, self.unknown, self.flagged, self.succeeded, self.failed]


@pytest.fixture
def world(store: Store) -> World:
    live = claim(store, "k-live")
    abandoned = claim(store, "k-abandoned", lease=timedelta(seconds=-60), possibly_sent=False)
    unknown = to_unknown(store, claim(store, "k-unknown"))
    flagged = to_unknown(
        store,
        claim(
            store,
            "k-flagged",
            tenant="shop-b",
            operation="payout.create",
            provider="stripe",
            request={"amount": 5000, "currency": "JPY", "destination": "ba_1"},
        ),
        attention=True,
    )
    succeeded = store.transition(
        claim(store, "k-ok"),
        State.SUCCEEDED,
        kind="provider_answer",
        actor="worker-1",
        provider_reference="eff_ok",
        response={"status": "succeeded", "http_status": 200},
    )
    failed = store.transition(
        claim(store, "k-declined", tenant="shop-b"),
        State.FAILED_FINAL,
        kind="provider_answer",
        actor="worker-1",
        error_code="card_declined",
        response={"status": "failed", "http_status": 402},
    )
    return World(live, abandoned, unknown, flagged, succeeded, failed)


def run(
    db_url: str, *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> Result:
    """Invoke the CLI; a single argument is split as a shell would split it."""
    argv = shlex.split(args[0]) if len(args) == 1 else list(args)
    return runner.invoke(app, [*argv, "--database-url", db_url], input=input, env=env)


def listed(db_url: str, *args: str) -> list[dict[str, Any]]:
    result = run(db_url, "ops", "list", "--json", *args)
    assert result.exit_code == 0, result.output
    items: list[dict[str, Any]] = json.loads(result.stdout)["items"]
    return items


def ids(items: list[dict[str, Any]]) -> set[str]:
    return {i["id"] for i in items}


def snapshot(store: Store) -> tuple[list[Any], int]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(operations).order_by(operations.c.id)).all()
        count = conn.execute(sa.select(sa.func.count()).select_from(events)).scalar_one()
    return [tuple(r) for r in rows], int(count)


def one_error_line(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    assert lines[0].startswith("error: ")
    return lines[0]


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


# -- stats, durations, databases ---------------------------------------------------------


def test_stats(db_url: str, store: Store, world: World) -> None:
    assert claim(store, "k-ok").id == world.succeeded.id  # two replays, counted on the row
    assert claim(store, "k-ok").id == world.succeeded.id
    store.append_event(world.failed, kind="key_reused", actor="executor", detail={})
    result = run(db_url, "stats", "--json", "--window", "1h")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["by_state"] == {
        "in_progress": 2,
        "outcome_unknown": 2,
        "succeeded": 1,
        "failed_final": 1,
    }
    assert data["needs_attention"] == 1
    assert (data["replays"], data["replayed_operations"], data["conflicts"]) == (2, 1, 1)
    assert data["by_provider"]["stripe"] == {"outcome_unknown": 1}
    assert data["oldest_unknown_created_at"] == world.unknown.created_at.isoformat()
    assert data["oldest_unknown_age_seconds"] >= 0
    assert stats(store, window=timedelta(hours=1), tenant_id="shop-b").total == 2
    table = run(db_url, "stats")
    assert table.exit_code == 0
    assert "1 operations replayed" in table.stdout and "replays in all: 2" in table.stdout
    assert "needs attention: 1" in table.stdout


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("15m", 900), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("0s", 0)],
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "15", "m", "15 minutes", "-5m", "1.5.2h", "5x"])
def test_malformed_duration_is_a_usage_error(db_url: str, text: str) -> None:
    result = run(db_url, "ops", "list", "--older-than", text)
    assert result.exit_code == 2
    assert "--older-than" in one_error_line(result)


def test_unreachable_database_is_one_line(tmp_path: Path) -> None:
    down = runner.invoke(
        app, ["ops", "list", "--database-url", "postgresql+psycopg://postgres@127.0.0.1:1/x"]
    )
    assert down.exit_code == 1
    assert "database unavailable" in one_error_line(down)
    missing = runner.invoke(
        app, ["ops", "list", "--database-url", f"sqlite:///{tmp_path / 'absent.db'}"]
    )
    assert missing.exit_code == 1
    assert "no database at" in one_error_line(missing)
    assert not (tmp_path / "absent.db").exists()


# -- the reconciler from the command line ----------------------------------------------


def test_reconcile_once_settles_what_is_due(db_url: str, store: Store, world: World) -> None:
    result = run(db_url, "reconcile once --json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"picked": 1, "outcomes": {"abandoned": 1}, "released": 0}
    # Nothing was sent: released (no outcome stored), the key's next request runs it again.
    abandoned = store.get(world.abandoned.tenant_id, world.abandoned.id)
    assert abandoned.released and abandoned.state is State.IN_PROGRESS
    assert abandoned.lease_owner is None and abandoned.response is None
    assert "nothing due" in run(db_url, "reconcile once").stdout


# -- a real process ----------------------------------------------------------------------


def payorch(db_url: str, command: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    return subprocess.run(
        [str(PAYORCH), *shlex.split(command), "--database-url", db_url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_real_subprocess(db_url: str, world: World) -> None:
    ok = payorch(db_url, "ops list --json --needs-attention")
    assert ok.returncode == 0, ok.stderr
    assert [i["id"] for i in json.loads(ok.stdout)["items"]] == [world.flagged.id]
    bad = payorch(db_url, "ops list --older-than soon")
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")
    refused = payorch(
        db_url, f"ops resolve {world.succeeded.id} --as failed_final --reason r --actor a --yes"
    )
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "terminal" in refused.stderr
    assert "Traceback" not in bad.stderr + refused.stderr


def test_reconcile_run_stops_on_sigterm(db_url: str, world: World) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYORCH_")}
    argv = [str(PAYORCH), "reconcile", "run", "--interval", "0.2", "--database-url", db_url]
    argv += ["--metrics-addr", "127.0.0.1:0"]  # a free port: the default may be taken here
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stderr is not None
        assert "a pass every 0.2s" in proc.stderr.readline()
        seen: list[str] = []
        while len(seen) < 3 and not any("abandoned=1" in line for line in seen):
            seen.append(proc.stderr.readline())  # the monitor's line, then the first pass
        assert "abandoned=1" in seen[-1], seen  # the first pass settles it
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert stdout.startswith("stopped after")


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


# -- effects unexplained -----------------------------------------------------------------


def _effects_executor(
    store: Store, sandbox_provider: SandboxProvider, key_scope: str = ""
) -> Executor:
    return Executor(
        store=store,
        providers=[sandbox_provider],
        registry=REGISTRY,
        lease=timedelta(seconds=30),
        sleep=lambda _seconds: None,
        key_scope=key_scope,
    )


def _effects_pay(executor: Executor, key: str) -> Any:
    return executor.execute(
        tenant_id="shop-a",
        operation="payment.create",
        idempotency_key=key,
        request={"amount": 2500, "currency": "EUR", "customer": "cus_3"},
    )


def _lost_charge(
    store: Store, sandbox_provider: SandboxProvider, key: str, key_scope: str = ""
) -> OperationRecord:
    """A payment made at the sandbox whose claim a failover then lost (its rows deleted)."""
    outcome = _effects_pay(_effects_executor(store, sandbox_provider, key_scope), key)
    record = store.get("shop-a", outcome.operation_id)
    with store.engine.begin() as conn:
        conn.execute(sa.delete(events).where(events.c.operation_id == record.id))
        conn.execute(sa.delete(operations).where(operations.c.id == record.id))
    return record


def test_effects_unexplained_lists_then_adopts_at_the_sandbox(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    lost = _lost_charge(store, sandbox_provider, "k-lost-claim")
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h"]

    listing = run(db_url, *args, "--json", env=env)
    assert listing.exit_code == 0, listing.output
    report = json.loads(listing.stdout)
    assert report["counts"]["unexplained"] == 1 and report["counts"]["adopted"] == 0
    (finding,) = report["findings"]
    assert finding["adoptable"] and finding["effect"]["tags"]["payorch_idempotency_key"] == (
        "k-lost-claim"
    )
    assert snapshot(store) == ([], 0)  # listing writes nothing

    adopted = run(
        db_url, *args, "--adopt", "--actor", "alice", "--reason", "failover", "--yes", env=env
    )
    assert adopted.exit_code == 0, adopted.output
    assert "1 adopted" in adopted.stdout
    record = store.get_by_namespace("shop-a", "payment.create", "k-lost-claim")
    assert record.state is State.SUCCEEDED and record.needs_attention
    assert record.downstream_key == lost.downstream_key
    (event,) = store.events("shop-a", record.id)
    assert (event.kind, event.actor) == ("adopted", "alice")
    assert f"adopted as {record.id}" in adopted.stdout

    again = run(db_url, *args, env=env)
    assert again.exit_code == 0
    assert "1 explained, 0 unexplained" in again.stdout
    assert len(sandbox.effects_for(lost.downstream_key)) == 1


def test_effects_unexplained_adopts_what_a_released_operation_says_was_never_sent(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    lost = _lost_charge(store, sandbox_provider, "k-released")
    # The client's retry re-creates the claim while the acquirer refuses every attempt.
    sandbox.inject(Fault.RATE_LIMIT, times=RetryPolicy().max_attempts)
    with pytest.raises(ProviderUnavailable) as caught:
        _effects_pay(_effects_executor(store, sandbox_provider), "k-released")
    held = store.get("shop-a", caught.value.operation_id or "")
    assert held.released
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h"]

    listing = run(db_url, *args, "--json", env=env)
    assert listing.exit_code == 0, listing.output
    (finding,) = json.loads(listing.stdout)["findings"]
    assert finding["verdict"] == "unexplained" and finding["adoptable"]
    assert finding["nothing_sent"] and finding["operation_id"] == held.id
    table = run(db_url, *args, env=env)
    assert f"unexplained (its operation says nothing was sent: {held.id}), adoptable" in (
        table.stdout
    )

    adopted = run(db_url, *args, "--adopt", "--actor", "alice", "--reason", "r", "--yes", env=env)
    assert adopted.exit_code == 0, adopted.output
    assert f"adopted as {held.id}" in adopted.stdout and "1 adopted" in adopted.stdout
    record = store.get("shop-a", held.id)
    assert record.state is State.SUCCEEDED and record.needs_attention and record.possibly_sent
    assert record.provider_reference is not None
    assert store.events("shop-a", held.id)[-1].kind == "adopted"
    retry = _effects_pay(_effects_executor(store, sandbox_provider), "k-released")
    assert retry.replayed and retry.operation_id == held.id
    assert len(sandbox.effects_for(lost.downstream_key)) == 1
    assert len(sandbox.ledger()) == 1


def test_effects_unexplained_reports_a_malformed_tag_and_adopts_the_rest(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    _lost_charge(store, sandbox_provider, "k-good")
    reply = httpx.post(
        f"{sandbox.url}/v1/operations/payment.create",
        json={
            "amount": 100,
            "currency": "EUR",
            "metadata": {
                "payorch_ref": namespace_ref("shop-a", "payment.create", '"k-bad'),
                "payorch_tenant_id": "shop-a",
                "payorch_operation": "payment.create",
                "payorch_idempotency_key": '"k-bad',  # opens a quote: no key of the store's
                "payorch_fingerprint": "ab" * 32,
            },
        },
        headers={"Idempotency-Key": "payorch:bad:submit"},
    )
    assert reply.status_code == 200
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h"]

    adopted = run(db_url, *args, "--adopt", "--actor", "a", "--reason", "r", "--yes", env=env)

    assert adopted.exit_code == 0, adopted.output
    assert "1 adopted" in adopted.stdout and "(1 not adoptable)" in adopted.stdout
    assert "not adoptable: its tags are malformed" in adopted.stdout
    record = store.get_by_namespace("shop-a", "payment.create", "k-good")
    assert record.state is State.SUCCEEDED and record.needs_attention


def test_effects_unexplained_skips_effects_of_another_key_scope(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    mine = _lost_charge(store, sandbox_provider, "k-scoped", key_scope="eu-1")
    theirs = _lost_charge(store, sandbox_provider, "k-scoped")  # an unscoped installation's
    env = {"PAYORCH_SANDBOX_URL": sandbox.url, "PAYORCH_KEY_SCOPE": "eu-1"}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h"]

    listing = run(db_url, *args, "--json", env=env)
    assert listing.exit_code == 0, listing.output
    report = json.loads(listing.stdout)
    assert report["counts"]["not_ours"] == 1 and report["counts"]["other_scope"] == 1
    (skipped,) = report["skipped"]
    assert "made under no key scope" in skipped["reason"]
    assert skipped["tags"]["payorch_ref"] == theirs.downstream_key.split(":")[1]
    (finding,) = report["findings"]
    assert finding["effect"]["tags"]["payorch_ref"] == mine.downstream_key.split(":")[1]

    adopted = run(db_url, *args, "--adopt", "--actor", "a", "--reason", "r", "--yes", env=env)
    assert adopted.exit_code == 0, adopted.output
    assert "1 not payorch's (1 under another key scope)" in adopted.stdout
    record = store.get_by_namespace("shop-a", "payment.create", "k-scoped")
    assert record.downstream_key == mine.downstream_key and record.needs_attention
    bad = run(db_url, *args, env={**env, "PAYORCH_KEY_SCOPE": "not ok"})
    assert bad.exit_code == 1 and "PAYORCH_KEY_SCOPE" in one_error_line(bad)


def test_effects_unexplained_adopt_asks_first_and_needs_an_audit_trail(
    db_url: str, store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    _lost_charge(store, sandbox_provider, "k-ask")
    env = {"PAYORCH_SANDBOX_URL": sandbox.url}
    args = ["effects", "unexplained", "--provider", "sandbox", "--since", "1h", "--adopt"]

    no_actor = run(db_url, *args, "--reason", "r", env=env)
    assert no_actor.exit_code == 2
    assert "--adopt needs --actor and --reason" in one_error_line(no_actor)
    declined = run(db_url, *args, "--actor", "a", "--reason", "r", input="n\n", env=env)
    assert declined.exit_code == 1
    assert "nothing adopted" in declined.stderr
    assert snapshot(store) == ([], 0)
    bad_since = run(db_url, "effects", "unexplained", "--provider", "sandbox", "--since", "soon")
    assert bad_since.exit_code == 2 and "neither an ISO 8601 time" in one_error_line(bad_since)


def test_effects_unexplained_on_a_provider_that_cannot_list_is_one_line(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SubmitsOnly:  # an adapter of the embedding app's, without list_effects
        name = "acquirer"

    monkeypatch.setattr("payorch.cli._effects.build_providers", lambda _config: [SubmitsOnly()])
    result = run(db_url, "effects unexplained --provider acquirer --since 2024-05-01T00:00Z")
    assert result.exit_code == 1
    assert "'acquirer' cannot list its effects" in one_error_line(result)
    unknown = run(db_url, "effects unexplained --provider nope --since 24h")
    assert unknown.exit_code == 1
    assert "no provider named 'nope'" in one_error_line(unknown)


def test_effects_unexplained_when_the_provider_is_down_is_one_line(db_url: str) -> None:
    env = {"PAYORCH_SANDBOX_URL": "http://127.0.0.1:9"}
    result = run(db_url, "effects unexplained --provider sandbox --since 1h", env=env)
    assert result.exit_code == 1
    assert "listing effects failed (ConnectError" in one_error_line(result)
