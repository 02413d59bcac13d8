"""A provider answer that arrives after the lease was lost is evidence, never discarded.

When the operation was meanwhile settled differently (reconciler, operator, webhook), the
late answer is stored as conflicting evidence and the operation flagged; an answer that
agrees, or says nothing final, stays a plain ``late_answer`` event.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from conftest import RecordingSleep, effects_of

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.outcome import Outcome, contradicts, late_conflict
from payorch.provider import Answer, AnswerKind, SubmitRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.storage._store import Store

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
MONEY = ("succeeded", "processing")


class Overtaken:
    """Submits for real; meanwhile someone else settles the operation as ``settle_as``.

    ``reference``: the provider reference that other party settled with (``"answer"``:
    the one the provider gives us, i.e. the same object).
    """

    name = "sandbox"

    def __init__(
        self, store: Store, real: SandboxProvider, settle_as: State, reference: str | None
    ) -> None:
        self.store = store
        self.real = real
        self.settle_as = settle_as
        self.reference = reference
        self.idempotency_window = real.idempotency_window
        self.max_call_duration = real.max_call_duration

    def submit(self, request: SubmitRequest) -> Answer:
        answer = self.real.submit(request)
        current = self.store.get(request.tenant_id, request.operation_id)
        ref = answer.provider_reference if self.reference == "answer" else self.reference
        self.store.transition(
            current,
            self.settle_as,
            kind="operator_resolution",
            actor="ops@example",
            resolution="operator",
            provider_reference=ref,
            error_code=None if self.settle_as is State.SUCCEEDED else "operator_resolved",
        )
        return answer

    def query_status(self, query: Any) -> Answer:
        raise NotImplementedError

    def parse_webhook(self, headers: Any, body: bytes) -> Any:
        raise NotImplementedError


def run_overtaken(
    store: Store,
    provider: SandboxProvider,
    *,
    settle_as: State,
    reference: str | None = None,
    **request: Any,
) -> Outcome:
    ex = Executor(
        store=store,
        providers=[Overtaken(store, provider, settle_as, reference)],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        sleep=RecordingSleep(),
        owner="slow-worker",
    )
    return ex.execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key="order-1",
        request={**PAYMENT, **request},
    )


def money(sandbox: SandboxServer, store: Store, op_id: str) -> int:
    return len([e for e in effects_of(sandbox, store, "shop", op_id) if e["status"] in MONEY])


def test_late_success_against_an_operator_failure_is_flagged_conflicting_evidence(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    outcome = run_overtaken(store, sandbox_provider, settle_as=State.FAILED_FINAL)
    record = store.get("shop", outcome.operation_id)
    # The operator's decision stands; the money the provider moved is kept and flagged.
    assert record.state is State.FAILED_FINAL and record.resolution == "operator"
    assert record.needs_attention and outcome.needs_attention
    last = store.events("shop", outcome.operation_id)[-1]
    assert last.kind == "conflicting_evidence" and last.actor == "slow-worker"
    assert last.detail is not None
    assert last.detail["kind"] == "succeeded" and last.detail["conflicts_with"] == "failed_final"
    (effect,) = effects_of(sandbox, store, "shop", outcome.operation_id)
    assert last.detail["provider_reference"] == effect["id"]
    assert money(sandbox, store, outcome.operation_id) == 1


def test_late_decline_against_a_success_is_flagged(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    outcome = run_overtaken(
        store,
        sandbox_provider,
        settle_as=State.SUCCEEDED,
        reference="sbx_operator",
        payment_method="pm_card_declined",
    )
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.SUCCEEDED and record.needs_attention
    last = store.events("shop", outcome.operation_id)[-1]
    assert last.kind == "conflicting_evidence"
    assert last.detail is not None and last.detail["conflicts_with"] == "succeeded"
    assert money(sandbox, store, outcome.operation_id) == 0


def test_late_success_naming_another_object_is_flagged(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    outcome = run_overtaken(
        store, sandbox_provider, settle_as=State.SUCCEEDED, reference="sbx_found_elsewhere"
    )
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.SUCCEEDED and record.needs_attention
    assert record.provider_reference == "sbx_found_elsewhere"  # never overwritten
    last = store.events("shop", outcome.operation_id)[-1]
    assert last.kind == "conflicting_evidence"
    assert last.detail is not None and "sbx_found_elsewhere" in last.detail["conflict"]


def test_late_answer_that_agrees_stays_a_plain_event(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    outcome = run_overtaken(store, sandbox_provider, settle_as=State.SUCCEEDED, reference="answer")
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.SUCCEEDED and not record.needs_attention
    kinds = [e.kind for e in store.events("shop", outcome.operation_id)]
    assert kinds[-1] == "late_answer" and "conflicting_evidence" not in kinds
    assert money(sandbox, store, outcome.operation_id) == 1


def test_inconclusive_late_answer_stays_a_plain_event(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    sandbox.inject("error_500_after")  # committed, but we only hear a 500
    outcome = run_overtaken(store, sandbox_provider, settle_as=State.FAILED_FINAL)
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.FAILED_FINAL and not record.needs_attention
    last = store.events("shop", outcome.operation_id)[-1]
    assert last.kind == "late_answer"
    assert last.detail is not None and last.detail["kind"] == "ambiguous"


# -- the rule itself (pure) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "kind", "expected"),
    [
        (State.SUCCEEDED, AnswerKind.DECLINED, True),
        (State.FAILED_FINAL, AnswerKind.SUCCEEDED, True),
        (State.SUCCEEDED, AnswerKind.SUCCEEDED, False),
        (State.FAILED_FINAL, AnswerKind.DECLINED, False),
        (State.SUCCEEDED, AnswerKind.PENDING, False),
        (State.FAILED_FINAL, AnswerKind.AMBIGUOUS, False),
        (State.OUTCOME_UNKNOWN, AnswerKind.SUCCEEDED, False),  # not settled: no conflict
        (State.IN_PROGRESS, AnswerKind.DECLINED, False),
    ],
)
def test_contradicts(state: State, kind: AnswerKind, expected: bool) -> None:
    assert contradicts(state, kind) is expected


def test_late_conflict_on_references() -> None:
    ok = Answer(kind=AnswerKind.SUCCEEDED, provider_reference="sbx_a")
    assert late_conflict(State.SUCCEEDED, "sbx_a", ok) is None
    assert late_conflict(State.SUCCEEDED, None, ok) is None
    assert late_conflict(State.SUCCEEDED, "sbx_b", ok) is not None
    pending = Answer(kind=AnswerKind.PENDING, provider_reference="sbx_c")
    assert late_conflict(State.SUCCEEDED, "sbx_a", pending) is None
