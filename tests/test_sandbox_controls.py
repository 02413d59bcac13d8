"""The sandbox server's run-time controls over real loopback HTTP: the ``/sandbox/…`` routes,
the ``timeout`` alias, base latency and jitter, webhook targets per tenant, their delay and
flush, and settlements that go out without anyone reading."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from payorch.providers.sandbox import Fault, SandboxServer, _webhooks
from payorch.providers.sandbox._faults import FaultPlan, parse_fault
from payorch.providers.sandbox._server import MAX_REQUEST_WAIT, MAX_WEBHOOK_DELAY

PAYMENT = {
    "amount": 1250,
    "currency": "EUR",
    "metadata": {"payorch_ref": "ref_1", "payorch_tenant_id": "shop-1"},
}
CREATE = "/v1/operations/payment.create"
WAIT = 30.0  # seconds a test waits at most for a delivery (bounded; normally immediate)


def pay(
    client: httpx.Client, key: str, body: dict[str, Any] = PAYMENT, *, fault: str | None = None
) -> Any:
    headers = {"Idempotency-Key": key}
    if fault is not None:
        headers["X-Sandbox-Fault"] = fault
    return client.post(CREATE, json=body, headers=headers)


@pytest.fixture
def sandbox() -> Iterator[SandboxServer]:
    with SandboxServer() as sb:
        yield sb


@pytest.fixture
def client(sandbox: SandboxServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sandbox.url, timeout=5.0) as c:
        yield c


class Receiver:
    """A loopback webhook receiver: every POST's path, headers and body, in arrival order."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.arrived = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(204)
                self.end_headers()
                with outer.arrived:
                    outer.received.append((self.path, dict(self.headers.items()), body))
                    outer.arrived.notify_all()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def wait_for(self, count: int) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.received) >= count, WAIT)


def done(sb: SandboxServer) -> dict[str, int]:
    """The sender's counts once nothing waits (a receiver sees a post before its sender
    has read the answer and counted it)."""
    deadline = time.monotonic() + WAIT
    while True:  # bounded: the deadline
        stats = sb.webhook_stats()
        if stats["waiting"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)  # a polling interval, not a synchronisation


# -- the fault queue over HTTP ----------------------------------------------------------------


def test_faults_are_queued_listed_and_cleared_over_http(
    sandbox: SandboxServer, client: httpx.Client
) -> None:
    queued = client.post("/sandbox/faults", json={"fault": "decline", "times": 2})
    assert queued.status_code == 200 and queued.json()["queued"] == ["decline", "decline"]
    client.post("/sandbox/faults", json={"fault": "timeout"})  # drop_after's other name
    assert sandbox.queued_faults() == [Fault.DECLINE, Fault.DECLINE, Fault.DROP_AFTER]
    assert pay(client, "k1").status_code == 402  # the first queued fault
    listed = client.get("/sandbox/faults").json()
    assert listed == {"queued": ["decline", "drop_after"], "rates": {}, "seen": {"decline": 1}}
    cleared = client.delete("/sandbox/faults").json()
    assert cleared["queued"] == [] and sandbox.queued_faults() == []
    assert pay(client, "k2").status_code == 200  # nothing left
    assert [e["status"] for e in sandbox.ledger()] == ["declined", "succeeded"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"fault": "meteor"}, "unknown_fault"),
        ({"times": 2}, "parameter_invalid"),
        ({"fault": "decline", "times": 0}, "parameter_invalid"),
        ({"fault": "decline", "times": "2"}, "parameter_invalid"),
        ({"fault": "decline", "times": True}, "parameter_invalid"),
    ],
)
def test_a_bad_fault_request_is_400_and_queues_nothing(
    sandbox: SandboxServer, client: httpx.Client, body: dict[str, Any], code: str
) -> None:
    refused = client.post("/sandbox/faults", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == code
    assert sandbox.queued_faults() == []


def test_control_routes_refuse_what_they_do_not_know(client: httpx.Client) -> None:
    assert client.post("/sandbox/faults", content=b"{").json()["error"]["code"] == "invalid_json"
    assert client.put("/sandbox/faults", json={}).status_code == 405
    assert client.get("/sandbox/webhooks/flush").status_code == 405
    assert client.get("/sandbox/nothing").status_code == 404
    assert client.get("/healthz").json() == {"ok": True}


def test_the_header_takes_the_timeout_alias_too() -> None:
    assert parse_fault(" Timeout ") is Fault.DROP_AFTER
    with SandboxServer(drop_hold_seconds=0.0) as sb:
        with pytest.raises(httpx.RemoteProtocolError):  # closed without an answer
            httpx.post(
                f"{sb.url}{CREATE}",
                json=PAYMENT,
                headers={"Idempotency-Key": "k1", "X-Sandbox-Fault": "timeout"},
                timeout=5.0,
            )
        assert [e["status"] for e in sb.ledger()] == ["succeeded"]  # made, answer lost
        assert sb.fault_log() == [Fault.DROP_AFTER]


# -- settling, the clock ------------------------------------------------------------------------


def test_a_pending_effect_is_settled_over_http_and_notified(
    sandbox: SandboxServer, client: httpx.Client
) -> None:
    made = pay(client, "k1", fault="pending").json()
    assert made["status"] == "processing"
    settled = client.post(f"/sandbox/effects/{made['id']}/settle", json={"outcome": "declined"})
    assert settled.status_code == 200 and settled.json()["status"] == "declined"
    again = client.post(f"/sandbox/effects/{made['id']}/settle", json={"outcome": "succeeded"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_settled"
    missing = client.post("/sandbox/effects/sbx_nothing/settle")
    assert missing.status_code == 404
    wrong = client.post(f"/sandbox/effects/{made['id']}/settle", json={"outcome": "processing"})
    assert wrong.status_code == 400
    types = [d.event_type for d in sandbox.webhook_deliveries()]
    assert types == ["effect.processing", "effect.declined"]


def test_advancing_the_clock_over_http_passes_the_idempotency_window(
    sandbox: SandboxServer, client: httpx.Client
) -> None:
    first = pay(client, "k1").json()
    assert pay(client, "k1").json()["id"] == first["id"]  # replayed inside the window
    bad = client.post("/sandbox/clock/advance", json={"seconds": -1})
    assert bad.status_code == 400
    assert client.post("/sandbox/clock/advance", json={"seconds": 86_400}).status_code == 200
    assert pay(client, "k1").json()["id"] != first["id"]  # past it: a second effect
    assert len(sandbox.ledger()) == 2


# -- latency ----------------------------------------------------------------------------------


def test_base_latency_holds_api_requests_but_not_the_controls() -> None:
    with SandboxServer(latency=3600.0) as sb:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{sb.url}{CREATE}", json=PAYMENT, headers={"Idempotency-Key": "k1"}, timeout=0.5
            )
        # The ledger listing and the controls answer at once; nothing was made yet.
        assert httpx.get(f"{sb.url}/v1/ledger", timeout=5.0).json() == {"data": []}
        assert httpx.get(f"{sb.url}/healthz", timeout=5.0).status_code == 200
    assert sb.ledger() == []  # stop() ended the wait before anything was committed


def test_jitter_is_seeded_and_bounded() -> None:
    def draws(seed: int) -> list[float]:
        plan = FaultPlan(seed=seed, latency=0.2, jitter=0.1)
        return [plan.request_delay() for _ in range(20)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    assert all(0.2 <= d <= 0.3 for d in draws(7))
    assert FaultPlan(latency=0.25).request_delay() == 0.25
    with pytest.raises(ValueError, match="jitter"):
        FaultPlan(jitter=-1.0)


# -- webhook targets ------------------------------------------------------------------------


def test_each_event_goes_to_every_target_with_the_tenant_filled_in() -> None:
    with Receiver() as one, Receiver() as other:
        targets = [f"{one.url}/webhooks/{{tenant}}/sandbox", f"{other.url}/all"]
        with (
            SandboxServer(webhook_url=targets) as sb,
            httpx.Client(base_url=sb.url, timeout=5.0) as client,
        ):
            pay(client, "k1")
            untagged = {"amount": 100, "currency": "EUR"}  # no tenant: {tenant} cannot be filled
            pay(client, "k2", untagged)
            assert other.wait_for(2)
            assert one.wait_for(1)
            stats = done(sb)
        assert [path for path, _, _ in one.received] == ["/webhooks/shop-1/sandbox"]
        assert [path for path, _, _ in other.received] == ["/all", "/all"]
        for _, headers, body in [*one.received, *other.received]:
            lowered = {k.lower(): v for k, v in headers.items()}
            Webhook(sb.webhook_secret).verify(body, lowered)  # signed, as payorch checks
        # One post per target and event; the untagged event could not reach the first.
        assert stats == {"events": 2, "sent": 3, "failed": 1, "waiting": 0}


def test_a_webhook_delay_holds_events_until_it_passes_or_a_flush() -> None:
    with Receiver() as receiver:
        with (
            SandboxServer(webhook_url=f"{receiver.url}/hook", webhook_delay=3600.0) as sb,
            httpx.Client(base_url=sb.url, timeout=5.0) as client,
        ):
            pay(client, "k1")
            waiting = client.get("/sandbox/webhooks").json()
            assert waiting["waiting"] == 1 and waiting["sent"] == 0
            assert waiting["delay_seconds"] == 3600.0 and receiver.received == []
            assert client.post("/sandbox/webhooks/flush").json() == {"flushed": 1}
            assert receiver.wait_for(1)
            assert done(sb)["sent"] == 1
            pay(client, "k2")  # made after the flush: it waits its own delay
            later = client.get("/sandbox/webhooks").json()
        assert json.loads(receiver.received[0][2])["type"] == "effect.succeeded"
        assert (later["events"], later["waiting"]) == (2, 1) and len(receiver.received) == 1


def test_a_settlement_is_posted_on_time_without_any_read() -> None:
    with Receiver() as receiver:
        with (
            SandboxServer(webhook_url=f"{receiver.url}/hook", settle_after=timedelta(0)) as sb,
            httpx.Client(base_url=sb.url, timeout=5.0) as client,
        ):
            pay(client, "k1", fault="pending")
            # Nothing reads the ledger: the server's own settling sends the second event.
            assert receiver.wait_for(2)
        types = [json.loads(body)["type"] for _, _, body in receiver.received]
        assert types == ["effect.processing", "effect.succeeded"]


def test_a_bad_webhook_target_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="loopback"):
        SandboxServer(webhook_url=["http://127.0.0.1:1/ok", "http://192.0.2.1/no"])
    with pytest.raises(ValueError, match="placeholder"):
        SandboxServer(webhook_url="http://127.0.0.1:1/{shop}")
    with pytest.raises(ValueError, match="http"):
        SandboxServer(webhook_url="ftp://127.0.0.1/hook")
    # Parsed as the sender parses it: a port that is not a number, or out of range.
    with pytest.raises(ValueError, match="Invalid port"):
        SandboxServer(webhook_url=["http://127.0.0.1:1/ok", "http://127.0.0.1:abc/hook"])
    with pytest.raises(ValueError, match=r"1\.\.65535"):
        SandboxServer(webhook_url="http://127.0.0.1:99999/hook")
    with pytest.raises(ValueError, match="host"):
        SandboxServer(webhook_url="http://[::1/hook")


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("webhook_delay", MAX_WEBHOOK_DELAY + 1),
        ("webhook_delay", 1e10),  # Condition.wait() would overflow
        ("latency", MAX_REQUEST_WAIT + 1),
        ("jitter", timedelta(days=2)),
        ("drop_hold_seconds", 10**400),  # too large for a float
        ("status_lag", timedelta(days=365 * 101)),
    ],
)
def test_a_duration_beyond_its_bound_is_refused_at_construction(setting: str, value: Any) -> None:
    with pytest.raises(ValueError, match=setting):
        SandboxServer(**{setting: value})


def test_a_post_that_fails_otherwise_counts_as_failed_and_the_sender_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A tenant that makes the filled-in URL longer than httpx takes: InvalidURL at the post,
    # not an httpx.HTTPError.
    huge = {**PAYMENT, "metadata": {"payorch_tenant_id": "t" * 70_000}}
    caplog.set_level(logging.WARNING, logger=_webhooks.__name__)
    with (
        Receiver() as receiver,
        SandboxServer(webhook_url=f"{receiver.url}/hooks/{{tenant}}") as sb,
        httpx.Client(base_url=sb.url, timeout=5.0) as client,
    ):
        assert pay(client, "k1", huge).status_code == 200
        assert pay(client, "k2").status_code == 200
        assert receiver.wait_for(1)  # the next event still went out
        stats = done(sb)
    assert [path for path, _, _ in receiver.received] == ["/hooks/shop-1"]
    assert stats == {"events": 2, "sent": 1, "failed": 1, "waiting": 0}
    (warning,) = [r for r in caplog.records if r.name == _webhooks.__name__]
    assert warning.levelno == logging.WARNING and "InvalidURL" in warning.getMessage()


def test_events_past_the_waiting_bound_count_as_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_webhooks, "MAX_WAITING", 2)
    caplog.set_level(logging.WARNING, logger=_webhooks.__name__)
    with (
        Receiver() as receiver,
        SandboxServer(webhook_url=f"{receiver.url}/hook", webhook_delay=3600.0) as sb,
        httpx.Client(base_url=sb.url, timeout=5.0) as client,
    ):
        for key in ("k1", "k2", "k3", "k4"):
            pay(client, key)
        full = sb.webhook_stats()
        assert sb.flush_webhooks() == 2
        assert receiver.wait_for(2)
        stats = done(sb)
    assert full == {"events": 4, "sent": 0, "failed": 2, "waiting": 2}
    assert stats == {"events": 4, "sent": 2, "failed": 2, "waiting": 0}
    assert len(receiver.received) == 2
    # Warned once for the overflow, not once per event dropped.
    assert len([r for r in caplog.records if "are waiting" in r.getMessage()]) == 1


def test_describe_names_the_settings() -> None:
    with SandboxServer(fault_rates={"timeout": 0.5}, latency=0.25, jitter=0.1) as sb:
        sb.inject("decline", 2)
        sb.inject("timeout")
        lines = sb.describe()
    assert lines[0] == f"sandbox acquirer listening on {sb.url}"
    assert "fault rates: drop_after=0.5" in lines
    assert "next faults: decline x2, drop_after x1" in lines
    assert "latency: 250ms + up to 100ms jitter" in lines
