"""The sandbox acquirer, driven over real loopback HTTP with plain httpx."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from payorch.providers.sandbox import Fault, SandboxServer, serve

PAYMENT = {
    "amount": 1250,
    "currency": "EUR",
    "customer": "cus_1",
    "payment_method": "pm_card_visa",
    # What payorch tags a request with (payorch.provider.provider_tags), abridged.
    "metadata": {"payorch_ref": "ref_1", "payorch_tenant_id": "t_1"},
}
CREATE = "/v1/operations/payment.create"


@pytest.fixture
def sandbox() -> Iterator[SandboxServer]:
    with SandboxServer() as sb:
        yield sb


@pytest.fixture
def client(sandbox: SandboxServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sandbox.url, timeout=5.0) as c:
        yield c


def post(
    client: httpx.Client,
    key: str | None,
    body: dict[str, Any] | None = None,
    *,
    fault: str | None = None,
    path: str = CREATE,
) -> httpx.Response:
    headers = {}
    if key is not None:
        headers["Idempotency-Key"] = key
    if fault is not None:
        headers["X-Sandbox-Fault"] = fault
    return client.post(path, json=PAYMENT if body is None else body, headers=headers)


def error_code(response: httpx.Response) -> Any:
    return response.json()["error"].get("code")


# -- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.com", "::"])
def test_refuses_non_loopback_hosts(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        SandboxServer(host=host)


def test_refuses_non_loopback_webhook_url() -> None:
    with pytest.raises(ValueError, match="loopback"):
        SandboxServer(webhook_url="http://example.com/hooks")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fault_rates": {"explode": 0.1}},
        {"fault_rates": {"decline": 1.5}},
        {"fault_rates": {"decline": 0.6, "rate_limit": 0.6}},
        {"idempotency_window": timedelta(seconds=-1)},
        {"webhook_secret": "whsec_not*base64"},
        {"webhook_secret": ""},
        {"retry_after": ""},
    ],
)
def test_refuses_bad_configuration(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SandboxServer(**kwargs)


def test_url_and_generated_secret(sandbox: SandboxServer) -> None:
    assert sandbox.url.startswith("http://127.0.0.1:")
    assert sandbox.webhook_secret.startswith("whsec_")
    Webhook(sandbox.webhook_secret)  # valid base64


def test_clock_only_moves_forward(sandbox: SandboxServer) -> None:
    with pytest.raises(ValueError):
        sandbox.advance(-1)


# -- the happy path and idempotency ------------------------------------------------------


def test_create_commits_one_effect(sandbox: SandboxServer, client: httpx.Client) -> None:
    response = post(client, "k1")
    assert response.status_code == 200
    effect = response.json()
    assert effect["id"].startswith("sbx_")
    assert effect["object"] == "effect"
    assert effect["status"] == "succeeded"
    assert effect["operation"] == "payment.create"
    assert (effect["amount"], effect["currency"]) == (1250, "EUR")
    assert effect["idempotency_key"] == "k1"
    assert effect["metadata"] == PAYMENT["metadata"]
    assert isinstance(effect["created"], int)
    assert "idempotent-replayed" not in response.headers
    assert sandbox.ledger() == [effect]
    # By the downstream key it was made under, or by the namespace ref it is tagged with.
    assert sandbox.effects_for("k1") == [effect]
    assert sandbox.effects_for("ref_1") == [effect]
    assert sandbox.effects_for("k_other") == sandbox.effects_for("ref_other") == []
    assert client.get(f"/v1/effects/{effect['id']}").json() == effect
    assert client.get("/v1/ledger").json() == {"data": [effect]}


def test_missing_idempotency_key(sandbox: SandboxServer, client: httpx.Client) -> None:
    response = post(client, None)
    assert response.status_code == 400
    assert response.json() == {
        "error": {"type": "invalid_request_error", "code": "missing_idempotency_key"}
    }
    assert sandbox.ledger() == []


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b"\xff\xfe", b""])
def test_body_must_be_a_json_object(
    sandbox: SandboxServer, client: httpx.Client, content: bytes
) -> None:
    response = client.post(CREATE, content=content, headers={"Idempotency-Key": "k"})
    assert response.status_code == 400
    assert error_code(response) == "invalid_json"
    assert sandbox.ledger() == []


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert error_code(client.get("/v2/nothing")) == "unknown_route"
    assert client.get(CREATE).status_code == 405
    assert client.delete("/v1/ledger").status_code == 405


def test_replay_returns_the_stored_answer(sandbox: SandboxServer, client: httpx.Client) -> None:
    first = post(client, "k1")
    # Same body with keys in another order: the canonical form matches.
    second = post(client, "k1", dict(reversed(list(PAYMENT.items()))))
    assert second.status_code == 200
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == first.content
    assert len(sandbox.ledger()) == 1


def test_key_reused_with_another_body(sandbox: SandboxServer, client: httpx.Client) -> None:
    post(client, "k1")
    changed = post(client, "k1", {**PAYMENT, "amount": 9999})
    assert changed.status_code == 400
    assert changed.json() == {
        "error": {"type": "idempotency_error", "code": "idempotency_key_reused"}
    }
    other_operation = post(client, "k1", path="/v1/operations/refund.create")
    assert error_code(other_operation) == "idempotency_key_reused"
    assert len(sandbox.ledger()) == 1


def test_key_is_forgotten_after_the_window() -> None:
    with (
        SandboxServer(idempotency_window=timedelta(hours=1)) as sb,
        httpx.Client(base_url=sb.url, timeout=5.0) as client,
    ):
        first = post(client, "k1").json()
        sb.advance(timedelta(minutes=59))
        assert post(client, "k1").headers.get("idempotent-replayed") == "true"
        sb.advance(timedelta(minutes=2))
        second = post(client, "k1")
        assert "idempotent-replayed" not in second.headers
        assert second.json()["id"] != first["id"]
        # The hazard the orchestrator must avoid: two effects for one key.
        assert len(sb.effects_for("k1")) == 2
        listed = client.get("/v1/effects", params={"idempotency_key": "k1"}).json()["data"]
        assert [e["id"] for e in listed] == [first["id"], second.json()["id"]]


def test_concurrent_same_key_gets_request_in_progress(
    sandbox: SandboxServer, client: httpx.Client
) -> None:
    results: list[httpx.Response] = []
    with sandbox.hold_commits() as gate:
        first = threading.Thread(target=lambda: results.append(post(client, "k1")))
        first.start()
        try:
            assert gate.wait_held(1, timeout=30)
            second = post(client, "k1")
            assert second.status_code == 409
            assert second.json()["error"] == {
                "type": "idempotency_error",
                "code": "request_in_progress",
            }
            assert second.headers["retry-after"] == "1"
            # Another body under the key in flight is a reuse, not "in progress".
            assert error_code(post(client, "k1", {**PAYMENT, "amount": 1})) == (
                "idempotency_key_reused"
            )
        finally:
            gate.release()
            first.join(30)
    assert results[0].status_code == 200
    assert post(client, "k1").headers["idempotent-replayed"] == "true"
    assert len(sandbox.ledger()) == 1


def test_many_concurrent_duplicates_make_one_effect(sandbox: SandboxServer) -> None:
    barrier = threading.Barrier(16)
    statuses: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(base_url=sandbox.url, timeout=5.0) as c:
            barrier.wait(60)  # bounded: sixteen threads on a loaded machine
            status = post(c, "same").status_code
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(statuses) == 16
    assert set(statuses) <= {200, 409}
    assert 200 in statuses
    assert len(sandbox.ledger()) == 1


# -- declines, faults --------------------------------------------------------------------


def test_declined_card(sandbox: SandboxServer, client: httpx.Client) -> None:
    response = post(client, "k1", {**PAYMENT, "payment_method": "pm_card_declined"})
    assert response.status_code == 402
    error = response.json()["error"]
    assert error["type"] == "card_error"
    assert error["code"] == "card_declined"
    assert error["decline_code"] == "generic_decline"
    [entry] = sandbox.ledger()
    assert entry["status"] == "declined"
    assert error["effect_id"] == entry["id"]
    replay = post(client, "k1", {**PAYMENT, "payment_method": "pm_card_declined"})
    assert replay.status_code == 402
    assert replay.headers["idempotent-replayed"] == "true"
    assert len(sandbox.ledger()) == 1


def test_decline_fault(sandbox: SandboxServer, client: httpx.Client) -> None:
    response = post(client, "k1", fault="decline")
    assert response.status_code == 402
    assert [e["status"] for e in sandbox.ledger()] == ["declined"]


def test_latency_fault_then_normal(sandbox: SandboxServer, client: httpx.Client) -> None:
    response = post(client, "k1", fault="latency")
    assert response.status_code == 200
    assert sandbox.fault_log() == [Fault.LATENCY]


def test_unknown_fault_header(sandbox: SandboxServer, client: httpx.Client) -> None:
    response = post(client, "k1", fault="meteor")
    assert response.status_code == 400
    assert error_code(response) == "unknown_fault"
    assert sandbox.ledger() == []


def test_error_500_before_commits_nothing(sandbox: SandboxServer, client: httpx.Client) -> None:
    response = post(client, "k1", fault="error_500_before")
    assert response.status_code == 500
    assert response.json() == {"error": {"type": "api_error"}}
    assert sandbox.ledger() == []
    # Not stored for replay: the retry executes.
    retry = post(client, "k1")
    assert retry.status_code == 200
    assert "idempotent-replayed" not in retry.headers
    assert len(sandbox.ledger()) == 1


def test_error_500_after_commits(sandbox: SandboxServer, client: httpx.Client) -> None:
    response = post(client, "k1", fault="error_500_after")
    assert response.status_code == 500
    assert response.json() == {"error": {"type": "api_error"}}
    [entry] = sandbox.ledger()
    assert entry["status"] == "succeeded"
    retry = post(client, "k1")  # the key remembers the real answer
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["id"] == entry["id"]


def test_rate_limit_commits_nothing() -> None:
    with (
        SandboxServer(retry_after="7") as sb,
        httpx.Client(base_url=sb.url, timeout=5.0) as client,
    ):
        response = post(client, "k1", fault="rate_limit")
        assert response.status_code == 429
        assert response.headers["retry-after"] == "7"
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert sb.ledger() == []
        assert "idempotent-replayed" not in post(client, "k1").headers


def test_drop_after_commits_and_holds_the_connection(sandbox: SandboxServer) -> None:
    with httpx.Client(base_url=sandbox.url, timeout=httpx.Timeout(5.0, read=2.0)) as c:
        with pytest.raises(httpx.ReadTimeout):
            post(c, "k1", fault="drop_after")
        [entry] = sandbox.ledger()
        retry = post(c, "k1")
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["id"] == entry["id"]


def test_reset_after_commits_and_resets(sandbox: SandboxServer, client: httpx.Client) -> None:
    with pytest.raises(httpx.ReadError):
        post(client, "k1", fault="reset_after")
    assert len(sandbox.ledger()) == 1
    assert post(client, "k1").headers["idempotent-replayed"] == "true"


def test_stop_cuts_held_connections() -> None:
    sb = SandboxServer(drop_hold_seconds=600)
    sb.start()
    with httpx.Client(base_url=sb.url, timeout=httpx.Timeout(5.0, read=2.0)) as c:
        with pytest.raises(httpx.ReadTimeout):
            post(c, "k1", fault="drop_after")
        idle = post(c, "k2")  # leaves an idle keep-alive connection open too
        assert idle.status_code == 200
        sb.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("sandbox-")]
    sb.stop()  # idempotent


def test_injected_queue_is_consumed_in_order(sandbox: SandboxServer, client: httpx.Client) -> None:
    sandbox.inject(Fault.RATE_LIMIT)
    sandbox.inject("error_500_before", times=2)
    statuses = [post(client, f"k{i}").status_code for i in range(4)]
    assert statuses == [429, 500, 500, 200]
    assert sandbox.fault_log() == [
        Fault.RATE_LIMIT,
        Fault.ERROR_500_BEFORE,
        Fault.ERROR_500_BEFORE,
        None,
    ]


def test_header_beats_queue(sandbox: SandboxServer, client: httpx.Client) -> None:
    sandbox.inject(Fault.RATE_LIMIT)
    assert post(client, "k1", fault="decline").status_code == 402
    assert post(client, "k2").status_code == 429  # the queued fault is still there


def run_with_rates(seed: int) -> tuple[list[int], list[Fault | None]]:
    rates = {"decline": 0.2, "rate_limit": 0.2, "error_500_before": 0.1, "error_500_after": 0.1}
    with (
        SandboxServer(fault_rates=rates, seed=seed) as sb,
        httpx.Client(base_url=sb.url, timeout=5.0) as client,
    ):
        statuses = [post(client, f"k{i}").status_code for i in range(40)]
        return statuses, sb.fault_log()


def test_seeded_rates_are_reproducible() -> None:
    statuses, faults = run_with_rates(seed=42)
    assert run_with_rates(seed=42) == (statuses, faults)
    assert {402, 429, 500, 200} <= set(statuses)
    assert run_with_rates(seed=43)[1] != faults


def test_get_honours_fault_header(sandbox: SandboxServer, client: httpx.Client) -> None:
    def status(fault: str) -> int:
        return client.get("/v1/ledger", headers={"X-Sandbox-Fault": fault}).status_code

    assert status("error_500_before") == 500
    assert status("rate_limit") == 429
    assert status("decline") == 200
    with pytest.raises(httpx.ReadError):
        status("reset_after")


# -- eventual consistency and pending effects -------------------------------------------


def test_status_lag_hides_young_effects() -> None:
    with (
        SandboxServer(status_lag=timedelta(seconds=30)) as sb,
        httpx.Client(base_url=sb.url, timeout=5.0) as client,
    ):
        effect = post(client, "k1").json()
        assert client.get(f"/v1/effects/{effect['id']}").status_code == 404
        assert error_code(client.get(f"/v1/effects/{effect['id']}")) == "resource_missing"
        assert client.get("/v1/effects", params={"idempotency_key": "k1"}).json() == {"data": []}
        assert len(client.get("/v1/ledger").json()["data"]) == 1  # the truth is there
        sb.advance(30)
        assert client.get(f"/v1/effects/{effect['id']}").json() == effect
        by_ref = client.get("/v1/effects", params={"payorch_ref": "ref_1"}).json()
        assert by_ref == {"data": [effect]}
        other = client.get("/v1/effects", params={"payorch_ref": "ref_other"}).json()
        assert other == {"data": []}


def test_pending_settles_after_time() -> None:
    with (
        SandboxServer(settle_after=timedelta(seconds=60)) as sb,
        httpx.Client(base_url=sb.url, timeout=5.0) as client,
    ):
        response = post(client, "k1", fault="pending")
        assert response.status_code == 200
        effect = response.json()
        assert effect["status"] == "processing"
        assert client.get(f"/v1/effects/{effect['id']}").json()["status"] == "processing"
        sb.advance(60)
        assert client.get(f"/v1/effects/{effect['id']}").json()["status"] == "succeeded"
        # The replay is the stored first answer, as with Stripe.
        assert post(client, "k1").json()["status"] == "processing"
        types = [d.event_type for d in sb.webhook_deliveries()]
        assert types == ["effect.processing", "effect.succeeded"]


def test_settle_on_demand(sandbox: SandboxServer, client: httpx.Client) -> None:
    first = post(client, "k1", fault="pending").json()
    second = post(client, "k2", fault="pending").json()
    assert sandbox.settle(first["id"])["status"] == "succeeded"
    assert sandbox.settle(first["id"])["status"] == "succeeded"  # no-op the second time
    assert sandbox.settle(second["id"], "declined")["status"] == "declined"
    with pytest.raises(ValueError):
        sandbox.settle(second["id"])
    with pytest.raises(KeyError):
        sandbox.settle("sbx_missing")
    assert [e["status"] for e in sandbox.ledger()] == ["succeeded", "declined"]


# -- webhooks ----------------------------------------------------------------------------


def test_every_change_is_a_signed_event(sandbox: SandboxServer, client: httpx.Client) -> None:
    effect = post(client, "k1").json()
    post(client, "k1")  # a replay changes nothing: no event
    post(client, "k2", fault="decline")
    deliveries = sandbox.webhook_deliveries()
    assert [d.event_type for d in deliveries] == ["effect.succeeded", "effect.declined"]
    verifier = Webhook(sandbox.webhook_secret)
    first = deliveries[0]
    event = verifier.verify(first.body, first.headers)
    assert event["id"] == first.event_id == first.headers["webhook-id"]
    assert event["type"] == "effect.succeeded"
    assert event["data"] == effect
    assert first.event_id.startswith("evt_")
    assert first.headers["webhook-signature"].startswith("v1,")


def test_webhooks_are_posted_to_webhook_url() -> None:
    received: list[tuple[dict[str, str], bytes]] = []
    arrived = threading.Event()

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
            if len(received) == 2:
                arrived.set()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=receiver.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        url = f"http://127.0.0.1:{receiver.server_address[1]}/hooks"
        with (
            SandboxServer(webhook_url=url) as sb,
            httpx.Client(base_url=sb.url, timeout=5.0) as client,
        ):
            post(client, "k1")
            post(client, "k2", fault="decline")
            assert arrived.wait(30)  # delivered by the sandbox's own thread
            deliveries = sb.webhook_deliveries()
        assert [body for _, body in received] == [d.body for d in deliveries]
        for headers, body in received:
            Webhook(sb.webhook_secret).verify(body, headers)
        assert sb.webhooks_sent == 2
        assert sb.webhook_failures == 0
    finally:
        receiver.shutdown()
        receiver.server_close()
        thread.join(5)


# -- serve() -----------------------------------------------------------------------------


def test_serve_runs_until_sigterm() -> None:
    seen: dict[str, Any] = {}

    def on_ready(sb: SandboxServer) -> None:
        with httpx.Client(base_url=sb.url, timeout=5.0) as client:
            seen["status"] = post(client, "k1").status_code
        seen["ledger"] = len(sb.ledger())
        signal.raise_signal(signal.SIGTERM)  # handled by serve(): a clean stop

    previous = signal.getsignal(signal.SIGTERM)
    serve("127.0.0.1", 0, on_ready=on_ready)
    assert seen == {"status": 200, "ledger": 1}
    assert signal.getsignal(signal.SIGTERM) == previous


def test_ledger_entries_are_copies(sandbox: SandboxServer, client: httpx.Client) -> None:
    post(client, "k1")
    sandbox.ledger()[0]["metadata"]["payorch_ref"] = "tampered"
    assert (
        json.loads(client.get("/v1/ledger").content)["data"][0]["metadata"] == (PAYMENT["metadata"])
    )
