"""Nothing retries forever unseen: failing checks count, adapter exceptions are classified.

A reconciler check that raises counts toward ``max_checks`` / ``max_unknown_age`` whatever
the operation's state, and ends flagged. An exception escaping an adapter's ``submit`` is
classified (possibly sent unless it could not have been), never propagated raw.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from typing import Any

from conftest import FAST_TIMEOUT, RecordingSleep, age, effects_of, make_due

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.provider import Answer, StatusQuery, SubmitRequest
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.records import OperationRecord
from payorch.storage._store import Store

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}


class QueryBreaks(SandboxProvider):
    def query_status(self, query: StatusQuery) -> Answer:
        raise RuntimeError("adapter bug in query_status")


class SubmitRaises(SandboxProvider):
    """Raises ``error`` from submit, optionally after sending the request for real."""

    def __init__(self, error: Exception, *, send_first: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error = error
        self.send_first = send_first

    def submit(self, request: SubmitRequest) -> Answer:
        if self.send_first:
            super().submit(request)
        raise self.error


def stranded(store: Store, *, possibly_sent: bool) -> str:
    """An in_progress operation whose worker died: its lease expired, it is due."""
    prepared = default_registry("sandbox").prepare(
        tenant_id="shop", operation="payment.create", idempotency_key="k1", request=PAYMENT
    )
    claim = store.claim(
        prepared.new, owner="dead-worker", lease=timedelta(seconds=30), possibly_sent=possibly_sent
    )
    make_due(store, claim.operation.id)
    return claim.operation.id


def reconciler(store: Store, provider: SandboxProvider, **policy: Any) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30), **policy),
        owner="test-reconciler",
    )


def test_in_progress_whose_checks_keep_raising_is_counted_then_flagged(
    store: Store, sandbox: SandboxServer
) -> None:
    op_id = stranded(store, possibly_sent=True)
    with QueryBreaks(base_url=sandbox.url, timeout=FAST_TIMEOUT) as broken:
        rec = reconciler(store, broken, max_checks=3)
        assert rec.reconcile_once().outcomes == Counter({"check_error": 1})
        first = store.get("shop", op_id)
        # Possibly sent and nobody's answer: unknown, counted, scheduled, lease released.
        assert first.state is State.OUTCOME_UNKNOWN and first.checks == 1
        assert not first.needs_attention and first.lease_owner is None
        assert first.next_check_at is not None
        for _ in range(2):  # bounded: max_checks passes in all
            make_due(store, op_id)
            assert rec.reconcile_once().outcomes == Counter({"check_error": 1})
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.checks == 3
    assert record.needs_attention
    errors = [e for e in store.events("shop", op_id) if e.kind == "check_error"]
    assert len(errors) == 3
    assert errors[-1].detail is not None and errors[-1].detail["error"] == "RuntimeError"
    assert sandbox.ledger() == []


def test_a_failing_check_past_max_unknown_age_is_flagged_at_once(
    store: Store, sandbox: SandboxServer
) -> None:
    op_id = stranded(store, possibly_sent=True)
    age(store, op_id, timedelta(hours=2))
    with QueryBreaks(base_url=sandbox.url, timeout=FAST_TIMEOUT) as broken:
        rec = reconciler(store, broken, max_unknown_age=timedelta(hours=1))
        assert rec.reconcile_once().outcomes == Counter({"check_error": 1})
    record = store.get("shop", op_id)
    assert record.checks == 1 and record.needs_attention


class AbandonBreaks(Reconciler):
    """A reconciler whose write of the abandonment (the release) fails (e.g. a bug, a bad
    row); its other writes work."""

    def _write(self, record: OperationRecord, state: State, **values: Any) -> OperationRecord:
        if values["kind"] == "abandoned":
            raise RuntimeError("cannot write the abandonment")
        return super()._write(record, state, **values)


def test_never_sent_in_progress_whose_check_raises_stays_in_progress_and_counts(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    op_id = stranded(store, possibly_sent=False)
    rec = AbandonBreaks(
        store=store,
        providers=[sandbox_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30), max_checks=2),
        owner="test-reconciler",
    )
    assert rec.reconcile_once().outcomes == Counter({"check_error": 1})
    first = store.get("shop", op_id)
    # Nothing was sent: it needs no provider's word, so it is not made unknown.
    assert first.state is State.IN_PROGRESS and first.checks == 1 and not first.possibly_sent
    assert first.lease_owner is None and isinstance(first.next_check_at, datetime)
    make_due(store, op_id)
    assert rec.reconcile_once().outcomes == Counter({"check_error": 1})
    flagged = store.get("shop", op_id)
    assert flagged.checks == 2 and flagged.needs_attention
    # Once the write works again, the next pass abandons it as usual: released (nothing
    # was sent, so no outcome is stored), and not due again.
    make_due(store, op_id)
    fixed = reconciler(store, sandbox_provider)
    assert fixed.reconcile_once().outcomes == Counter({"abandoned": 1})
    released = store.get("shop", op_id)
    assert released.released and released.state is State.IN_PROGRESS
    assert released.lease_owner is None and not released.possibly_sent
    assert released.response is None and released.next_check_at is None
    assert [e.kind for e in store.events("shop", op_id)][-1] == "abandoned"
    assert fixed.reconcile_once().picked == 0
    assert sandbox.ledger() == []


def executor_with(store: Store, adapter: SandboxProvider) -> Executor:
    return Executor(
        store=store,
        providers=[adapter],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        sleep=RecordingSleep(),
        owner="test-executor",
    )


def run(ex: Executor) -> Any:
    return ex.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="k1", request=PAYMENT
    )


def test_unexpected_adapter_exception_is_possibly_sent_and_flagged(
    store: Store, sandbox: SandboxServer
) -> None:
    # The adapter sent the request (the provider committed) and then blew up.
    with SubmitRaises(
        KeyError("id"), send_first=True, base_url=sandbox.url, timeout=FAST_TIMEOUT
    ) as adapter:
        outcome = run(executor_with(store, adapter))
    assert outcome.state is State.OUTCOME_UNKNOWN and outcome.needs_attention
    record = store.get("shop", outcome.operation_id)
    assert record.possibly_sent and record.next_check_at is not None
    last = store.events("shop", outcome.operation_id)[-1]
    assert last.kind == "provider_answer" and last.detail is not None
    assert last.detail["kind"] == "ambiguous" and last.detail["code"] == "adapter_error"
    assert "KeyError" in last.detail["message"]
    assert len(effects_of(sandbox, store, "shop", outcome.operation_id)) == 1
    # The reconciler then finds the truth from evidence.
    make_due(store, outcome.operation_id)
    with SandboxProvider(base_url=sandbox.url, timeout=FAST_TIMEOUT) as good:
        assert reconciler(store, good).reconcile_once().outcomes == Counter({"succeeded": 1})


def test_an_unencodable_request_in_the_adapter_is_not_sent_and_flagged(
    store: Store, sandbox: SandboxServer
) -> None:
    error = UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
    with SubmitRaises(error, send_first=False, base_url=sandbox.url, timeout=FAST_TIMEOUT) as a:
        outcome = run(executor_with(store, a))
    # Could not be turned into bytes: nothing reached the provider, and never will for this
    # request. A final answer that asks for another request (422), flagged for a human; not
    # a 503 that would send the client back with the same key for ever.
    assert outcome.state is State.FAILED_FINAL and outcome.http_status == 422
    assert outcome.error_code == "request_unencodable" and outcome.needs_attention
    record = store.get("shop", outcome.operation_id)
    assert not record.possibly_sent
    last = store.events("shop", outcome.operation_id)[-1]
    assert last.kind == "provider_answer"
    assert last.detail is not None and last.detail["code"] == "request_unencodable"
    assert [e.kind for e in store.events("shop", outcome.operation_id)].count("attempt") == 0
    assert sandbox.ledger() == []


def test_a_resubmission_whose_adapter_raises_is_classified(
    store: Store, sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    sandbox.inject("error_500_before")
    outcome = run(executor_with(store, sandbox_provider))
    assert outcome.state is State.OUTCOME_UNKNOWN
    make_due(store, outcome.operation_id)
    age(store, outcome.operation_id, timedelta(minutes=5))
    with SubmitRaises(
        RuntimeError("adapter bug in submit"),
        send_first=False,
        base_url=sandbox.url,
        timeout=FAST_TIMEOUT,
    ) as broken:
        rec = reconciler(store, broken, not_found_grace=timedelta(minutes=1))
        assert rec.reconcile_once().outcomes == Counter({"resubmitted_outcome_unknown": 1})
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    kinds = [e.kind for e in store.events("shop", outcome.operation_id)]
    assert kinds[-2:] == ["resubmit", "resubmission"]
    assert sandbox.ledger() == []
