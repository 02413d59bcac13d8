"""The kit's checks an adapter must pass to be routed to (``payorch.routing``).

A router moves an operation to its next provider only on proof that the current attempt did
not execute. The proofs come from the adapter: a refused connection classified as not sent,
a final decline with a code a router can list, and a declared idempotency window past which
"not found" means something. An adapter that gets one of them wrong turns a fallback into a
second charge, so each is checked here, end to end through a routed executor.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ..execution._executor import Executor, RetryPolicy
from ..migrate import upgrade
from ..operations import default_registry
from ..provider import STATUS_CAPABILITIES, AnswerKind, Capability, Provider, capabilities_of
from ..routing import Router, Rule, attempts_of
from ..storage._store import Store
from ._emulator import Emulator, Fault
from ._requests import KIT_TENANT, status_query
from ._support import KitBase, close_adapter, explain, require_fault

__all__ = ["RouteContract"]

_UNREACHABLE = "kit_unreachable"


class _Renamed:
    """An adapter under another name (a router needs two providers): every other
    attribute is the adapter's own."""

    def __init__(self, inner: Provider, name: str) -> None:
        self._inner = inner
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._inner, attribute)


class RouteContract(KitBase):
    """What routing relies on: the proofs of "did not execute" the adapter gives."""

    @pytest.fixture
    def routed(self, emulator: Emulator, adapter: Provider, tmp_path: Path) -> Iterator[Executor]:
        """An executor routing ``payment.create`` first to an unreachable copy of the
        adapter, then to the adapter, over a throwaway SQLite store."""
        down = emulator.unreachable_adapter()
        url = f"sqlite:///{tmp_path / 'routed.db'}"
        upgrade(url)
        store = Store.from_url(url)
        try:
            yield Executor(
                store=store,
                providers=[_Renamed(down, _UNREACHABLE), adapter],
                registry=default_registry(provider=adapter.name),
                lease=adapter.max_call_duration * 2 + timedelta(seconds=30),
                retry=RetryPolicy(max_attempts=1),
                key_scope="",
                router=Router(
                    [Rule(operation="payment.create", providers=[_UNREACHABLE, adapter.name])],
                    health=None,
                ),
            )
        finally:
            store.close()
            close_adapter(down)

    def test_routable_a_refused_connection_moves_on_with_one_effect(
        self, emulator: Emulator, adapter: Provider, routed: Executor
    ) -> None:
        outcome = routed.execute(
            tenant_id=KIT_TENANT,
            operation="payment.create",
            idempotency_key=f"kit-{uuid.uuid4().hex}",
            request=emulator.payload("payment.create"),
        )
        assert outcome.state.value == "succeeded", outcome
        assert outcome.provider == adapter.name, "the answer names the provider that settled"
        record = routed.store.get(outcome.tenant_id, outcome.operation_id)
        first, second = attempts_of(record.route)
        assert first["proof"] == "not_sent", "a refused connection is proof nothing was sent"
        assert second["downstream_key"] == record.downstream_key != first["downstream_key"]
        assert emulator.effects(record.downstream_key) == 1
        assert emulator.effects(first["downstream_key"]) == 0

    def test_routable_a_decline_names_its_code_and_stays_declined(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        require_fault(emulator, Fault.DECLINE, adapter)
        request = self.payment(emulator)
        emulator.inject(Fault.DECLINE)
        answer = adapter.submit(request)
        assert answer.kind is AnswerKind.DECLINED, explain(answer)
        # A router lists decline codes that may move an operation on: a decline needs one,
        # and it must be a final decline, never a "not now" that could still charge.
        assert isinstance(answer.code, str) and answer.code, f"no code: {explain(answer)}"
        if Capability.STATUS_BY_KEY in capabilities_of(adapter):
            asked = adapter.query_status(status_query(request))
            assert asked.kind in (AnswerKind.DECLINED, AnswerKind.NOT_FOUND), explain(asked)
        assert emulator.effects(request.downstream_key) == 0

    def test_routable_the_window_is_declared_for_not_found(self, adapter: Provider) -> None:
        # "Not found past the provider's window" moves an unknown operation on: only a
        # window the provider honours makes it proof; without one it never moves.
        window = adapter.idempotency_window
        if window is None:
            pytest.skip("no idempotency window: a 'not found' never moves an operation on")
        assert window > timedelta(0), f"idempotency_window must be positive, not {window!r}"
        evidence = STATUS_CAPABILITIES | {Capability.WEBHOOKS, Capability.REPLAY}
        assert capabilities_of(adapter) & evidence, (
            "a routed adapter must give evidence: a status query, a replay or webhooks"
        )
