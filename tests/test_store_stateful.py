"""Hypothesis explores claims, transitions and stale writes against a model (SQLite)."""

from __future__ import annotations

import shutil
import tempfile
from datetime import timedelta
from functools import cache
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from payorch import migrate
from payorch.core import State
from payorch.errors import (
    IdempotencyKeyReused,
    InvalidTransition,
    OperationInProgress,
    StaleVersion,
)
from payorch.operations import default_registry
from payorch.records import OperationRecord
from payorch.storage._store import Store
from payorch.storage._tables import operations

KEYS = ("a", "b", "c")
AMOUNTS = (100, 200)
LEASE = timedelta(seconds=30)
REGISTRY = default_registry("sandbox")


@cache
def _template() -> Path:
    path = Path(tempfile.mkdtemp(prefix="payorch-hyp-")) / "template.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="payorch-hyp-"))
        shutil.copyfile(_template(), self.dir / "db.sqlite")
        self.store = Store.from_url(f"sqlite:///{self.dir / 'db.sqlite'}")
        self.amount: dict[str, int] = {}  # key -> amount of its first claim
        self.latest: dict[str, OperationRecord] = {}
        self.stale: dict[str, OperationRecord] = {}  # an older snapshot, if any
        self.writes = 0  # events the store must hold
        self.replays: dict[str, int] = {}  # counted on the row, not logged

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _new(self, key: str, amount: int) -> object:
        return REGISTRY.prepare(
            tenant_id="t",
            operation="payment.create",
            idempotency_key=key,
            request={"amount": amount, "currency": "EUR"},
        ).new

    @rule(key=st.sampled_from(KEYS), amount=st.sampled_from(AMOUNTS))
    def claim(self, key: str, amount: int) -> None:
        new = self._new(key, amount)
        if key not in self.amount:
            res = self.store.claim(new, owner="w", lease=LEASE)  # type: ignore[arg-type]
            assert res.created
            self.amount[key] = amount
            self.latest[key] = res.operation
            self.writes += 1
            return
        current = self.latest[key]
        if amount != self.amount[key]:
            with pytest.raises(IdempotencyKeyReused):
                self.store.claim(new, owner="w", lease=LEASE)  # type: ignore[arg-type]
            self.writes += 1  # the refusal is noted in the log
        elif current.released:
            # Nothing sent and nobody holding it: the claim takes the operation over.
            res = self.store.claim(new, owner="w", lease=LEASE)  # type: ignore[arg-type]
            assert res.created and res.operation.id == current.id
            assert res.operation.version == current.version + 1
            self.stale[key] = current
            self.latest[key] = res.operation
            self.writes += 1
        elif current.state is State.IN_PROGRESS:
            with pytest.raises(OperationInProgress):
                self.store.claim(new, owner="w", lease=LEASE)  # type: ignore[arg-type]
        else:
            res = self.store.claim(new, owner="w", lease=LEASE)  # type: ignore[arg-type]
            assert not res.created and res.operation.id == current.id
            assert res.replayed is current.state.terminal
            if current.state.terminal:
                self.replays[key] = self.replays.get(key, 0) + 1

    @precondition(lambda self: bool(self.latest))
    @rule(data=st.data(), to=st.sampled_from(list(State)))
    def move(self, data: st.DataObject, to: State) -> None:
        key = data.draw(st.sampled_from(sorted(self.latest)))
        current = self.latest[key]
        if current.state.terminal:
            with pytest.raises(InvalidTransition):
                self.store.transition(current, to, kind="test", actor="m")
            return
        moved = self.store.transition(current, to, kind="test", actor="m")
        assert moved.version == current.version + 1
        self.stale[key] = current
        self.latest[key] = moved
        self.writes += 1

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def stale_write(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.stale)))
        old = self.stale[key]
        with pytest.raises(StaleVersion):
            self.store.transition(old, State.OUTCOME_UNKNOWN, kind="stale", actor="zombie")

    @invariant()
    def store_matches_model(self) -> None:
        events = 0
        for key, record in self.latest.items():
            stored = self.store.get("t", record.id)
            assert stored.state is record.state and stored.version == record.version
            events += len(self.store.events("t", record.id))
            with self.store.engine.connect() as conn:
                replays = conn.execute(
                    sa.select(operations.c.replays).where(operations.c.id == record.id)
                ).scalar_one()
            assert replays == self.replays.get(key, 0)
        assert events == self.writes


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=30, stateful_step_count=15, deadline=None)
