"""Operations in every state and a runner for the operator CLI, shared by the CLI's tests."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from typer.testing import CliRunner, Result

from payorch.cli._app import app
from payorch.core import State
from payorch.operations import default_registry
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

LIVE = timedelta(minutes=5)
REGISTRY = default_registry("sandbox")
runner = CliRunner()


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


def make_world(store: Store) -> World:
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
