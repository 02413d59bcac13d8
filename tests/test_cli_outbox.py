"""``payorch outbox`` on real databases: list, dead, show, retry (audited), relay; hooks
loaded by path in the CLI (an operator's resolution stages its messages); the outbox in
``payorch stats``; bad input answered in one line, nothing changed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta

import outbox_apps
import pytest
import sqlalchemy as sa
from cli_helpers import claim, one_error_line, run, to_unknown

from payorch.outbox import Message, find, stage
from payorch.storage._store import Store
from payorch.storage._tables import events, outbox

HOOKS = {"PAYORCH_OUTBOX_HOOKS": "outbox_apps:hooks"}
SINKS = {"PAYORCH_OUTBOX_SINKS": "outbox_apps:sinks"}


@pytest.fixture(autouse=True)
def _fresh_recorder() -> Iterator[None]:
    outbox_apps.recorder.got.clear()
    yield


def _dead_and_pending(store: Store) -> tuple[str, str]:
    with store.engine.begin() as conn:
        dead, pending = stage(
            conn,
            [
                Message("merchant.notify", "payment", "p-1", {"n": 1}),
                Message("merchant.notify", "payment", "p-2", {"n": 2}),
            ],
            tenant_id="shop-a",
        )
        conn.execute(
            sa.update(outbox)
            .where(outbox.c.id == dead)
            .values(state="dead", attempts=12, last_error="http_410")
        )
    return dead, pending


def test_list_dead_and_show(db_url: str, store: Store) -> None:
    dead, pending = _dead_and_pending(store)
    listed = run(db_url, "outbox list --json")
    assert listed.exit_code == 0, listed.output
    assert [m["id"] for m in json.loads(listed.stdout)] == [pending, dead]
    only_dead = json.loads(run(db_url, "outbox dead --json").stdout)
    assert [(m["id"], m["last_error"], m["attempts"]) for m in only_dead] == [
        (dead, "http_410", 12)
    ]
    table = run(db_url, "outbox dead")
    assert table.exit_code == 0 and dead in table.stdout and "http_410" in table.stdout
    assert pending not in table.stdout
    shown = json.loads(run(db_url, f"outbox show {pending} --json").stdout)
    assert shown["payload"] == {"n": 2} and shown["state"] == "pending"
    assert run(db_url, "outbox list --state delivered").stdout.strip() == "no messages"


def test_retry_is_audited_and_bad_input_changes_nothing(db_url: str, store: Store) -> None:
    dead, _ = _dead_and_pending(store)
    done = run(db_url, f"outbox retry {dead} --reason 'endpoint fixed' --actor ops@shop")
    assert done.exit_code == 0, done.output
    again = find(store, dead)
    assert (again.state, again.attempts) == ("pending", 0)
    with store.engine.connect() as conn:
        kinds = conn.execute(
            sa.select(events.c.kind, events.c.actor).where(events.c.operation_id == dead)
        ).all()
    assert kinds == [("outbox_retry", "ops@shop")]
    for args, code, text in [
        ("outbox retry no-such-message --reason r", 1, "no outbox message"),
        (f"outbox retry {dead} --reason ' '", 2, "must not be empty"),
        ("outbox list --state lost", 2, "not one of"),
    ]:
        result = run(db_url, args)
        assert result.exit_code == code, result.output
        assert text in one_error_line(result)
    assert find(store, dead).attempts == 0  # nothing changed by the refusals


def test_relay_once_delivers_to_the_configured_sinks(db_url: str, store: Store) -> None:
    _, pending = _dead_and_pending(store)
    done = run(db_url, "outbox relay --once --json", env=SINKS)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["delivered"] == 1
    assert [m.id for m in outbox_apps.recorder.got] == [pending]
    assert outbox_apps.recorder.closed
    assert find(store, pending).state == "delivered"


def test_relay_without_sinks_or_with_a_bad_path_says_so_in_one_line(db_url: str) -> None:
    for env, text in [
        ({}, "no sinks: set PAYORCH_OUTBOX_SINKS"),
        ({"PAYORCH_OUTBOX_SINKS": "outbox_apps:missing"}, "cannot load"),
        ({"PAYORCH_OUTBOX_SINKS": "no_such_module_x:sinks"}, "cannot load"),
        ({"PAYORCH_OUTBOX_SINKS": "outbox_apps:hooks"}, "not a mapping"),
        ({"PAYORCH_OUTBOX_HOOKS": "outbox_apps:not_hooks"}, "is not an OutboxHooks"),
        ({"PAYORCH_OUTBOX_HOOKS": "outbox_broken:hooks"}, "RuntimeError: the application's"),
    ]:
        result = run(db_url, "outbox relay --once", env=env)
        assert result.exit_code == 1, result.output
        assert text in one_error_line(result)
    # Hooks are loaded by every command that opens the store: a broken module is one line.
    listed = run(db_url, "ops list", env={"PAYORCH_OUTBOX_HOOKS": "outbox_broken:hooks"})
    assert listed.exit_code == 1 and "cannot load" in one_error_line(listed)


def test_purge_deletes_only_old_delivered_messages(db_url: str, store: Store) -> None:
    dead, pending = _dead_and_pending(store)
    done = run(db_url, "outbox purge --older-than 1d --dry-run")
    assert done.exit_code == 0 and "would delete 0 delivered messages" in done.stdout
    assert run(db_url, "outbox purge --older-than 0s").exit_code == 1  # not positive
    assert {m["id"] for m in json.loads(run(db_url, "outbox list --json").stdout)} == {
        dead,
        pending,
    }


def test_an_operators_resolution_stages_the_hooks_messages(db_url: str, store: Store) -> None:
    unknown = to_unknown(store, claim(store, "k-unknown", lease=timedelta(seconds=-1)))
    done = run(
        db_url,
        f"ops resolve {unknown.id} --as succeeded --reason 'seen in the dashboard' "
        "--actor ops --yes",
        env=HOOKS,
    )
    assert done.exit_code == 0, done.output
    with store.engine.connect() as conn:
        staged = conn.execute(sa.select(outbox.c.type, outbox.c.operation_id)).all()
    assert staged == [("receipt.requested", unknown.id)]


def test_stats_shows_the_outbox(db_url: str, store: Store) -> None:
    _dead_and_pending(store)
    result = run(db_url, "stats --json")
    assert result.exit_code == 0, result.output
    box = json.loads(result.stdout)["outbox"]
    assert (box["pending"], box["dead"], box["delivered"], box["due"]) == (1, 1, 0, 1)
    text = run(db_url, "stats").stdout
    assert "outbox: 1 pending (1 due" in text and "1 dead" in text
