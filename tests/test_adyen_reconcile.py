"""An Adyen operation left unknown, settled the three ways a webhook-only provider allows:
by its notification alone, by a replay inside the key window, by a void past its deadline.
Effects and requests are counted at the Adyen-shaped emulator; notifications reach payorch
over real HTTP on loopback, batched and signed, answered ``[accepted]``."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from conftest import age, make_due

from payorch.core import State
from payorch.execution._executor import Executor, RetryPolicy
from payorch.http import webhook_answer
from payorch.providers.adyen import AdyenProvider
from payorch.providers.adyen.emulator import AdyenEmulator
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.reconciling._webhooks import WebhookHandler
from payorch.storage._store import Store
from payorch.testing import Fault


@pytest.fixture
def adyen(adyen_emulator: AdyenEmulator) -> Iterator[AdyenProvider]:
    with adyen_emulator.adapter() as provider:
        yield provider


@pytest.fixture
def endpoint(store: Store, adyen: AdyenProvider) -> Iterator[str]:
    """payorch's webhook endpoint for tenant "shop", served on loopback."""
    handler = WebhookHandler(store=store, providers=[adyen])

    class Handle(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                result: Any = handler.handle_delivery("shop", "adyen", dict(self.headers), body)
            except Exception as exc:
                result = exc
            answer = webhook_answer(result)
            content = answer.content()
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.content_type)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/webhooks/shop/adyen"
    finally:
        server.shutdown()
        server.server_close()


def executor(store: Store, adyen: AdyenProvider) -> Executor:
    return Executor(store=store, providers=[adyen], retry=RetryPolicy(max_attempts=1))


def reconciler(store: Store, adyen: AdyenProvider, **policy: Any) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[adyen],
        policy=ReconcilerPolicy(lease=timedelta(seconds=60), **policy),
        owner="test-reconciler",
    )


def unknown_payment(
    store: Store, adyen: AdyenProvider, emulator: AdyenEmulator, key: str, **payload: Any
) -> str:
    emulator.inject(Fault.DROP_AFTER_COMMIT)
    outcome = executor(store, adyen).execute(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key=key,
        request=emulator.payload("payment.create", **payload),
        provider="adyen",
    )
    assert outcome.state is State.OUTCOME_UNKNOWN
    return outcome.operation_id


def requests_to(emulator: AdyenEmulator) -> Counter[str]:
    return Counter(r["path"] for r in emulator.received)


def test_settled_by_its_notification_alone(
    store: Store,
    adyen: AdyenProvider,
    adyen_emulator: AdyenEmulator,
    endpoint: str,
) -> None:
    op_id = unknown_payment(store, adyen, adyen_emulator, "adyen-n1")
    key = store.get("shop", op_id).downstream_key
    make_due(store, op_id)
    # Inside the webhook grace the reconciler asks nothing: Adyen cannot be asked.
    sent_before = len(adyen_emulator.received)
    report = reconciler(store, adyen).reconcile_once()
    assert report.outcomes == Counter({"awaiting_evidence": 1})
    assert len(adyen_emulator.received) == sent_before
    # The notification arrives, batched and signed, over HTTP: accepted and applied.
    assert adyen_emulator.deliver(endpoint) >= 1
    record = store.get("shop", op_id)
    assert record.state is State.SUCCEEDED and record.resolution == "webhook"
    assert adyen_emulator.effects(key) == 1
    # Delivered again (a provider retry): every item a duplicate, nothing changes.
    headers, body = adyen_emulator.delivery([key])
    again = WebhookHandler(store=store, providers=[adyen]).handle_delivery(
        "shop", "adyen", headers, body
    )
    assert [r.status.value for r in again.results] == ["duplicate"]
    assert store.get("shop", op_id).version == record.version


def test_settled_by_a_replay_inside_the_window(
    store: Store,
    adyen: AdyenProvider,
    adyen_emulator: AdyenEmulator,
) -> None:
    op_id = unknown_payment(store, adyen, adyen_emulator, "adyen-r1")
    key = store.get("shop", op_id).downstream_key
    age(store, op_id, timedelta(minutes=10))  # past the grace, no notification came
    make_due(store, op_id)
    report = reconciler(store, adyen).reconcile_once()
    assert report.outcomes == Counter({"replayed_succeeded": 1})
    record = store.get("shop", op_id)
    assert record.state is State.SUCCEEDED and record.resolution == "replay"
    assert adyen_emulator.effects(key) == 1  # the replay answered the first payment
    assert requests_to(adyen_emulator)["/v71/payments"] == 2


def test_past_the_window_it_waits_for_evidence_flagged(
    store: Store,
    adyen: AdyenProvider,
    adyen_emulator: AdyenEmulator,
) -> None:
    op_id = unknown_payment(store, adyen, adyen_emulator, "adyen-w1")
    age(store, op_id, timedelta(days=32))
    make_due(store, op_id)
    sent_before = len(adyen_emulator.received)
    report = reconciler(store, adyen).reconcile_once()
    assert report.outcomes == Counter({"escalated": 1})
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert len(adyen_emulator.received) == sent_before  # never re-sent past the window


def test_voided_past_its_deadline(
    store: Store,
    adyen: AdyenProvider,
    adyen_emulator: AdyenEmulator,
    endpoint: str,
) -> None:
    op_id = unknown_payment(store, adyen, adyen_emulator, "adyen-v1", capture_method="manual")
    key = store.get("shop", op_id).downstream_key
    # The authorisation's own notification never came (lost); the deadline passes.
    lost = len(adyen_emulator.notifications())
    age(store, op_id, timedelta(hours=3))
    make_due(store, op_id)
    report = reconciler(store, adyen, void_after=timedelta(hours=2)).reconcile_once()
    assert report.outcomes == Counter({"void_pending": 1})
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.resolution == "void_requested"
    # The cancel's TECHNICAL_CANCEL notification settles it.
    cancel = [i for i in adyen_emulator.notifications()[lost:]]
    assert [i["eventCode"] for i in cancel] == ["TECHNICAL_CANCEL"]
    headers, body = adyen_emulator.sign(cancel)
    result = WebhookHandler(store=store, providers=[adyen]).handle_delivery(
        "shop", "adyen", headers, body
    )
    assert [r.status.value for r in result.results] == ["applied"]
    record = store.get("shop", op_id)
    assert record.state is State.FAILED_FINAL and record.error_code == "voided"
    assert record.resolution == "void" and not record.needs_attention
    assert adyen_emulator.voided(key) and adyen_emulator.effects(key) == 1


def test_a_late_authorisation_racing_the_void_is_flagged(
    store: Store,
    adyen: AdyenProvider,
    adyen_emulator: AdyenEmulator,
    endpoint: str,
) -> None:
    op_id = unknown_payment(store, adyen, adyen_emulator, "adyen-v2", capture_method="manual")
    age(store, op_id, timedelta(hours=3))
    make_due(store, op_id)
    reconciler(store, adyen, void_after=timedelta(hours=2)).reconcile_once()
    # Both notifications arrive now in one batch: the authorisation, then the cancel.
    assert adyen_emulator.deliver(endpoint) == 2
    record = store.get("shop", op_id)
    assert record.state is State.FAILED_FINAL and record.error_code == "voided"
    assert record.needs_attention  # the success raced the void: a human looks
    kinds = [e.kind for e in store.events("shop", op_id)]
    assert "void_race" in kinds


def test_one_tampered_item_is_refused_and_the_others_applied(
    store: Store,
    adyen: AdyenProvider,
    adyen_emulator: AdyenEmulator,
) -> None:
    first = unknown_payment(store, adyen, adyen_emulator, "adyen-t1")
    second = unknown_payment(store, adyen, adyen_emulator, "adyen-t2")
    keys = [store.get("shop", op).downstream_key for op in (first, second)]
    handler = WebhookHandler(store=store, providers=[adyen])
    headers, body = adyen_emulator.delivery(keys, tampered={1})
    delivery = handler.handle_delivery("shop", "adyen", headers, body)
    answer = webhook_answer(delivery)
    assert answer.status == 400  # not accepted: Adyen sends it again
    assert [i for i, _ in delivery.rejected] == [1]
    assert store.get("shop", first).state is State.SUCCEEDED
    assert store.get("shop", second).state is State.OUTCOME_UNKNOWN
    # Adyen's retry of the whole delivery, intact: the first a duplicate, the second applied.
    headers, body = adyen_emulator.delivery(keys)
    retry = handler.handle_delivery("shop", "adyen", headers, body)
    assert [r.status.value for r in retry.results] == ["duplicate", "applied"]
    assert webhook_answer(retry).content() == b"[accepted]"
    assert store.get("shop", second).state is State.SUCCEEDED
    assert all(adyen_emulator.effects(k) == 1 for k in keys)
