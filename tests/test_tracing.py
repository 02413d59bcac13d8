"""OpenTelemetry spans, read back from the SDK's in-memory exporter, and the ``traceparent``
the sandbox acquirer received; and the no-op path when OpenTelemetry is absent."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import make_due
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from payorch import WebhookHandler, WebhookStatus
from payorch.core import State
from payorch.errors import IdempotencyKeyReused
from payorch.execution._executor import Executor
from payorch.observing import _tracing as tracing
from payorch.operations import default_registry
from payorch.providers.sandbox import Fault, SandboxProvider, SandboxServer
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.storage._store import Store

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
KEY = "order-trace-1"


@pytest.fixture(scope="module")
def provider() -> Iterator[TracerProvider]:
    """An SDK provider for payorch alone: OpenTelemetry's global one is set once per process,
    and other test modules should not trace."""
    sdk = TracerProvider()
    tracing.use_tracer_provider(sdk)
    yield sdk
    tracing.use_tracer_provider(None)
    sdk.shutdown()


@pytest.fixture(scope="module")
def exporter(provider: TracerProvider) -> InMemorySpanExporter:
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def traceparent(request: dict[str, Any]) -> tuple[int, int]:
    """(trace id, parent span id) of a request's W3C traceparent header."""
    version, trace_id, span_id, flags = request["headers"]["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    return int(trace_id, 16), int(span_id, 16)


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_one_execute_with_a_retried_attempt_is_one_span_tree(
    executor: Executor, sandbox: SandboxServer, store: Store, spans: InMemorySpanExporter
) -> None:
    sandbox.inject(Fault.RATE_LIMIT)  # 429 first: certainly not sent, retried inline
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=KEY, request=PAYMENT
    )
    assert outcome.state is State.SUCCEEDED
    finished = list(spans.get_finished_spans())

    [root] = named(finished, "payorch.execute")
    assert root.parent is None  # the test opened no span: execute() is the root
    assert {s.context.trace_id for s in finished} == {root.context.trace_id}
    assert attrs(root) == {
        "payorch.operation": "payment.create",
        "payorch.tenant_id": "shop",
        "payorch.provider": "sandbox",  # the type's default, named by the claim
        "payorch.operation_id": outcome.operation_id,
        "payorch.state": "succeeded",
        "payorch.replayed": False,
        "payorch.needs_attention": False,
    }
    assert root.status.status_code is StatusCode.UNSET

    # claim, attempt 1, its record, attempt 2, the outcome's record: in that order.
    tree = sorted(children(finished, root), key=lambda s: s.start_time or 0)
    assert [s.name for s in tree] == [
        "payorch.claim",
        "payorch.provider.submit",
        "payorch.record",
        "payorch.provider.submit",
        "payorch.record",
    ]
    claim, first, retry_record, second, final_record = tree
    assert attrs(claim)["payorch.created"] is True
    assert attrs(claim)["payorch.replayed"] is False

    record = store.get("shop", outcome.operation_id)
    key_hash = hashlib.sha256(record.downstream_key.encode()).hexdigest()[:16]
    assert attrs(first) == {
        "payorch.provider": "sandbox",
        "payorch.operation_id": outcome.operation_id,
        "payorch.attempt": 1,
        "payorch.downstream_key_hash": key_hash,
        "payorch.answer_kind": "not_sent",
        "payorch.possibly_sent": False,
        "payorch.status_code": 429,
        "payorch.answer_code": "rate_limited",
    }
    assert attrs(second)["payorch.attempt"] == 2
    assert attrs(second)["payorch.answer_kind"] == "succeeded"
    assert attrs(second)["payorch.possibly_sent"] is True
    assert attrs(second)["payorch.downstream_key_hash"] == key_hash
    assert attrs(retry_record) == {
        "payorch.operation_id": outcome.operation_id,
        "payorch.from_state": "in_progress",
        "payorch.to_state": "in_progress",
        "payorch.event": "attempt",
    }
    assert attrs(final_record)["payorch.to_state"] == "succeeded"
    assert attrs(final_record)["payorch.event"] == "provider_answer"
    # Neither key travels in a span: only the digest of the downstream one.
    for span in finished:
        values = " ".join(str(v) for v in attrs(span).values())
        assert KEY not in values and record.downstream_key not in values

    # The acquirer saw both attempts, each under its own submit span, in the same trace.
    posts = [r for r in sandbox.requests() if r["method"] == "POST"]
    assert len(posts) == 2
    assert [traceparent(r) for r in posts] == [
        (root.context.trace_id, first.context.span_id),
        (root.context.trace_id, second.context.span_id),
    ]
    assert len([e for e in sandbox.ledger() if e["status"] == "succeeded"]) == 1


def test_a_replay_and_a_refusal_are_spans_without_provider_calls(
    executor: Executor, sandbox: SandboxServer, spans: InMemorySpanExporter
) -> None:
    def pay(amount: int) -> Any:
        return executor.execute(
            tenant_id="shop",
            operation="payment.create",
            idempotency_key=KEY,
            request={**PAYMENT, "amount": amount},
        )

    first = pay(1250)
    spans.clear()
    again = pay(1250)
    assert again.replayed
    with pytest.raises(IdempotencyKeyReused):
        pay(999)
    finished = list(spans.get_finished_spans())
    replay, refused = sorted(named(finished, "payorch.execute"), key=lambda s: s.start_time or 0)
    assert attrs(replay)["payorch.replayed"] is True
    assert attrs(replay)["payorch.operation_id"] == first.operation_id
    assert [s.name for s in children(finished, replay)] == ["payorch.claim"]
    assert attrs(children(finished, replay)[0])["payorch.replayed"] is True
    # A reused key is the contract at work: named on the span, not an error status.
    assert attrs(refused)["payorch.error"] == "IdempotencyKeyReused"
    assert refused.status.status_code is StatusCode.UNSET
    assert not named(finished, "payorch.provider.submit")
    assert len(sandbox.requests()) == 1  # only the first execute() reached the acquirer


def test_reconcile_check_and_webhook_spans(
    store: Store,
    sandbox: SandboxServer,
    sandbox_provider: SandboxProvider,
    spans: InMemorySpanExporter,
) -> None:
    executor = Executor(
        store=store,
        providers=[sandbox_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=30),
        owner="w",
    )
    sandbox.inject(Fault.ERROR_500_AFTER)  # committed there, 500 here: unknown
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=KEY, request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    make_due(store, outcome.operation_id)
    spans.clear()
    reconciler = Reconciler(
        store=store,
        providers=[sandbox_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=30)),
    )
    report = reconciler.reconcile_once()
    assert report.outcomes["succeeded"] == 1
    [check] = named(list(spans.get_finished_spans()), "payorch.reconcile.check")
    assert attrs(check) == {
        "payorch.operation_id": outcome.operation_id,
        "payorch.tenant_id": "shop",
        "payorch.operation": "payment.create",
        "payorch.provider": "sandbox",
        "payorch.from_state": "outcome_unknown",
        "payorch.result": "succeeded",
    }
    status_query = [r for r in sandbox.requests() if r["method"] == "GET"][-1]
    assert traceparent(status_query) == (check.context.trace_id, check.context.span_id)

    spans.clear()
    handler = WebhookHandler(store=store, providers=[sandbox_provider])
    delivery = sandbox.webhook_deliveries()[0]
    result = handler.handle("shop", "sandbox", delivery.headers, delivery.body)
    assert result.status is WebhookStatus.RECORDED  # already settled by the check
    [hook] = named(list(spans.get_finished_spans()), "payorch.webhook")
    assert attrs(hook)["payorch.status"] == "recorded"
    assert attrs(hook)["payorch.operation_id"] == outcome.operation_id
    assert attrs(hook)["payorch.tenant_id"] == "shop"


def test_the_callers_span_is_the_parent(
    executor: Executor,
    sandbox: SandboxServer,
    provider: TracerProvider,
    spans: InMemorySpanExporter,
) -> None:
    tracer = provider.get_tracer("the-app")
    with tracer.start_as_current_span("POST /payments") as request_span:
        executor.execute(
            tenant_id="shop", operation="payment.create", idempotency_key=KEY, request=PAYMENT
        )
    [root] = named(list(spans.get_finished_spans()), "payorch.execute")
    # Sync, or async (the task runs in a copy of the caller's context): the app's span leads.
    assert root.parent is not None
    assert root.parent.span_id == request_span.get_span_context().span_id
    [post] = sandbox.requests()
    assert traceparent(post)[0] == root.context.trace_id


# -- without OpenTelemetry --------------------------------------------------------------------

_NO_OTEL = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    if sys.argv[1] == "blocked":
        sys.meta_path.insert(0, Block())
    else:  # installed, imported, but no SDK: the API's default provider
        import opentelemetry.trace

    from datetime import timedelta
    from payorch import migrate, tracing
    from payorch import Executor, Store
    from payorch.operations import default_registry
    from payorch.providers.sandbox import Fault, SandboxProvider, SandboxServer

    url = "sqlite:///" + sys.argv[2]
    migrate.upgrade(url)
    store = Store.from_url(url)
    with SandboxServer() as sandbox, SandboxProvider(base_url=sandbox.url) as provider:
        sandbox.inject(Fault.RATE_LIMIT)
        ex = Executor(store=store, providers=[provider], sleep=lambda s: None,
                      registry=default_registry("sandbox"))
        out = ex.execute(tenant_id="t", operation="payment.create", idempotency_key="k-1",
                         request={"amount": 100, "currency": "EUR"})
        assert out.state.value == "succeeded", out
        assert not tracing.enabled()
        assert all("traceparent" not in r["headers"] for r in sandbox.requests())
        assert len(sandbox.requests()) == 2
    loaded = sys.modules.get("opentelemetry")
    print("otel-loaded" if loaded is not None else "otel-absent")
    """
)


@pytest.mark.parametrize(("mode", "expected"), [("blocked", "otel-absent"), ("api", "otel-loaded")])
def test_without_an_sdk_or_the_package_tracing_is_a_no_op(
    tmp_path: Path, mode: str, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAYORCH_", "OTEL_"))}
    proc = subprocess.run(
        [sys.executable, "-c", _NO_OTEL, mode, str(tmp_path / "t.db")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [expected]


def test_inject_adds_nothing_outside_a_span() -> None:
    assert tracing.inject({"a": "b"}) == {"a": "b"}
    assert trace.get_current_span() is trace.INVALID_SPAN
    assert tracing.downstream_key_hash("k") == hashlib.sha256(b"k").hexdigest()[:16]


def test_a_batched_delivery_is_one_span_saying_what_it_carried(
    store: Store, adyen_emulator: Any, spans: InMemorySpanExporter
) -> None:
    from payorch.reconciling._webhooks import WebhookHandler
    from payorch.testing import Fault

    with adyen_emulator.adapter() as adyen:
        executor = Executor(store=store, providers=[adyen], lease=timedelta(seconds=60))
        keys = []
        for key in ("trace-a1", "trace-a2"):
            adyen_emulator.inject(Fault.DROP_AFTER_COMMIT)
            outcome = executor.execute(
                tenant_id="shop",
                operation="payment.create",
                idempotency_key=key,
                request=adyen_emulator.payload("payment.create"),
                provider="adyen",
            )
            keys.append(store.get("shop", outcome.operation_id).downstream_key)
        spans.clear()
        headers, body = adyen_emulator.delivery(keys, tampered={1})
        handler = WebhookHandler(store=store, providers=[adyen])
        delivery = handler.handle_delivery("shop", "adyen", headers, body)
    assert len(delivery.results) == 1 and len(delivery.rejected) == 1
    [span] = named(list(spans.get_finished_spans()), "payorch.webhook")
    got = attrs(span)
    assert got["payorch.items"] == 2 and got["payorch.refused"] == 1
    assert got["payorch.status"] == "applied"
    assert got["payorch.error"] == "WebhookSignatureInvalid"
