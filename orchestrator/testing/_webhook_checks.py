"""The kit's checks of webhooks: signed, tampered, duplicated, batched and out of order."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from ..core import State
from ..errors import WebhookSignatureInvalid
from ..execution._executor import Executor, RetryPolicy
from ..migrate import upgrade
from ..operations import default_registry
from ..outcome import WebhookResult, WebhookStatus
from ..provider import AnswerKind, Capability, Provider, WebhookEvent, parse_deliveries
from ..reconciling._operator import resolve
from ..reconciling._webhooks import WebhookHandler
from ..storage._store import Store
from ._emulator import Delivery, Emulator, Fault
from ._requests import KIT_TENANT
from ._support import COMMITTED_FAULTS, HOOKS, KitBase, require_capability

__all__ = ["WebhookContract", "throwaway_stack"]


def _names(event: WebhookEvent, key: str, reference: str | None) -> bool:
    """Whether ``event`` names the effect made under ``key`` (by key or by reference)."""
    return event.downstream_key == key or (
        reference is not None and event.provider_reference == reference
    )


@dataclass
class Stack:
    """A real executor and webhook handler over a throwaway SQLite store."""

    store: Store
    executor: Executor
    handler: WebhookHandler
    provider: str

    def unknown(self, emulator: Emulator, fault: Fault) -> tuple[str, str]:
        """An operation left ``outcome_unknown`` by ``fault``: (operation id, downstream key)."""
        emulator.inject(fault)
        outcome = self.executor.execute(
            tenant_id=KIT_TENANT,
            operation="payment.create",
            idempotency_key=f"kit-{uuid.uuid4().hex}",
            request=emulator.payload("payment.create"),
        )
        assert outcome.state is State.OUTCOME_UNKNOWN, f"{fault.value}: {outcome.state.value}"
        record = self.store.get(KIT_TENANT, outcome.operation_id)
        return record.id, record.downstream_key

    def take(self, deliveries: Sequence[Delivery]) -> list[WebhookResult]:
        """Each delivery through the handler's batch API: every item's result, in order."""
        results: list[WebhookResult] = []
        for headers, body in deliveries:
            taken = self.handler.handle_delivery(KIT_TENANT, self.provider, headers, body)
            assert not taken.rejected, f"refused items: {taken.rejected}"
            assert taken.http_status == 200
            results.extend(taken.results)
        return results

    def settled_by_webhook(self, operation_id: str) -> int:
        """How many times a webhook moved the operation."""
        events = self.store.events(KIT_TENANT, operation_id)
        return sum(1 for e in events if e.kind == "webhook")


@contextlib.contextmanager
def throwaway_stack(adapter: Provider, directory: Path) -> Iterator[Stack]:
    """A migrated SQLite store in ``directory``, with an executor and a webhook handler for
    ``adapter`` (one attempt per call: a not-sent answer is not retried inline)."""
    url = f"sqlite:///{directory / 'kit.db'}"
    upgrade(url)
    store = Store.from_url(url)
    try:
        executor = Executor(
            store=store,
            providers=[adapter],
            registry=default_registry(provider=adapter.name),
            lease=adapter.max_call_duration * 2 + timedelta(seconds=30),
            retry=RetryPolicy(max_attempts=1),
            key_scope="",
        )
        handler = WebhookHandler(store=store, providers=[adapter])
        yield Stack(store=store, executor=executor, handler=handler, provider=adapter.name)
    finally:
        store.close()


def deliveries_for(emulator: Emulator, keys: Sequence[str]) -> list[Delivery]:
    """The deliveries that report ``keys`` in this order: one where the emulator batches,
    else one per key."""
    groups = [list(keys)] if emulator.batches else [[k] for k in keys]
    return [emulator.delivery(group) for group in groups]


def _committed_fault(emulator: Emulator) -> Fault:
    """A fault that leaves the effect made and the answer lost: what makes an operation
    unknown for a webhook to settle. Every adapter that declares webhooks needs one."""
    for fault in (Fault.ERROR_AFTER_COMMIT, Fault.DROP_AFTER_COMMIT):
        if fault in emulator.faults:
            return fault
    hooks = " or ".join(f"Fault.{f.name} ({HOOKS[f]})" for f in sorted(COMMITTED_FAULTS))
    pytest.fail(f"the emulator lacks a committed-fault hook: implement {hooks}", pytrace=False)


class WebhookContract(KitBase):
    """Where the adapter declares webhooks: what a delivery proves, and what it cannot."""

    def test_a_signed_delivery_names_its_effect(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        require_capability(adapter, Capability.WEBHOOKS)
        request = self.payment(emulator)
        reference = self.assert_succeeded(adapter.submit(request))
        headers, body = emulator.delivery([request.downstream_key])
        [item] = parse_deliveries(adapter, headers, body).items
        assert item.event is not None, f"a signed delivery verifies: {item.rejected!r}"
        assert item.event.event_id, "an event has an id (the inbox dedupes by it)"
        assert _names(item.event, request.downstream_key, reference), item.event
        assert item.event.outcome is AnswerKind.SUCCEEDED, item.event

    def test_a_tampered_delivery_is_refused(self, emulator: Emulator, adapter: Provider) -> None:
        require_capability(adapter, Capability.WEBHOOKS)
        request = self.payment(emulator)
        self.assert_succeeded(adapter.submit(request))
        headers, body = emulator.delivery([request.downstream_key], tampered={0})
        try:
            batch = parse_deliveries(adapter, headers, body)
        except WebhookSignatureInvalid:
            return
        [item] = batch.items
        assert item.event is None, f"a tampered event verified: {item.event}"
        assert isinstance(item.rejected, WebhookSignatureInvalid), repr(item.rejected)

    def test_a_duplicate_delivery_is_the_same_event(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        require_capability(adapter, Capability.WEBHOOKS)
        request = self.payment(emulator)
        self.assert_succeeded(adapter.submit(request))
        headers, body = emulator.delivery([request.downstream_key])
        [first] = parse_deliveries(adapter, headers, body).items
        [again] = parse_deliveries(adapter, headers, body).items
        assert first.event is not None and again.event is not None
        assert again.event.event_id == first.event.event_id
        assert again.event.outcome is first.event.outcome

    def test_a_batch_carries_one_item_per_key_in_order(
        self, emulator: Emulator, adapter: Provider
    ) -> None:
        require_capability(adapter, Capability.WEBHOOKS)
        if not emulator.batches:
            pytest.skip("the emulator's provider sends one event per delivery")
        requests = [self.payment(emulator) for _ in range(3)]
        references = [self.assert_succeeded(adapter.submit(r)) for r in requests]
        keys = [r.downstream_key for r in requests]
        batch = parse_deliveries(adapter, *emulator.delivery(keys))
        assert [item.index for item in batch.items] == [0, 1, 2]
        for item, key, reference in zip(batch.items, keys, references, strict=True):
            assert item.event is not None, repr(item.rejected)
            assert _names(item.event, key, reference), item.event
            assert item.event.outcome is AnswerKind.SUCCEEDED, item.event
        assert len({i.event.event_id for i in batch.items if i.event}) == 3

    def test_a_tampered_item_is_refused_alone(self, emulator: Emulator, adapter: Provider) -> None:
        require_capability(adapter, Capability.WEBHOOKS)
        if not emulator.batches:
            pytest.skip("the emulator's provider sends one event per delivery")
        requests = [self.payment(emulator) for _ in range(3)]
        for r in requests:
            self.assert_succeeded(adapter.submit(r))
        keys = [r.downstream_key for r in requests]
        batch = parse_deliveries(adapter, *emulator.delivery(keys, tampered={1}))
        first, tampered, last = batch.items
        assert first.event is not None, repr(first.rejected)
        assert _names(first.event, keys[0], None) or first.event.provider_reference, first.event
        assert tampered.event is None, f"a tampered item verified: {tampered.event}"
        assert isinstance(tampered.rejected, WebhookSignatureInvalid), repr(tampered.rejected)
        assert last.event is not None, repr(last.rejected)

    # -- through payorch's handler --------------------------------------------------------

    def test_out_of_order_deliveries_settle_each_operation_once(
        self, emulator: Emulator, adapter: Provider, tmp_path: Path
    ) -> None:
        require_capability(adapter, Capability.WEBHOOKS)
        fault = _committed_fault(emulator)
        with throwaway_stack(adapter, tmp_path) as stack:
            made = [stack.unknown(emulator, fault) for _ in range(3)]
            backwards = list(reversed(made))
            deliveries = deliveries_for(emulator, [key for _, key in backwards])
            results = stack.take(deliveries)
            assert [r.status for r in results] == [WebhookStatus.APPLIED] * 3, results
            assert [r.operation_id for r in results] == [op for op, _ in backwards]
            for op_id, key in made:
                record = stack.store.get(KIT_TENANT, op_id)
                assert record.state is State.SUCCEEDED, record.state
                assert record.provider_reference, "the webhook named the effect"
                assert stack.settled_by_webhook(op_id) == 1
                assert emulator.effects(key) == 1
            # The same deliveries again (the provider re-sends): duplicates, nothing moves.
            again = stack.take(deliveries)
            assert [r.status for r in again] == [WebhookStatus.DUPLICATE] * 3, again
            assert all(stack.settled_by_webhook(op_id) == 1 for op_id, _ in made)

    def test_contradicting_evidence_is_flagged_not_applied(
        self, emulator: Emulator, adapter: Provider, tmp_path: Path
    ) -> None:
        require_capability(adapter, Capability.WEBHOOKS)
        fault = _committed_fault(emulator)
        with throwaway_stack(adapter, tmp_path) as stack:
            op_id, key = stack.unknown(emulator, fault)
            # An operator decided it failed; the provider says the effect succeeded.
            resolve(
                stack.store,
                KIT_TENANT,
                op_id,
                to=State.FAILED_FINAL,
                reason="adapter kit: decided before the evidence came",
                actor="adapter-kit",
            )
            [result] = stack.take(deliveries_for(emulator, [key]))
            assert result.status is WebhookStatus.CONFLICT, result
            record = stack.store.get(KIT_TENANT, op_id)
            assert record.state is State.FAILED_FINAL, "evidence never rewrites a final state"
            assert record.needs_attention, "a contradiction is flagged for a human"
            assert stack.settled_by_webhook(op_id) == 0
            assert emulator.effects(key) == 1
