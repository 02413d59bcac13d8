"""The Adyen adapter against the Adyen emulator on loopback: ledgers, replays, faults,
cancels and notifications, counted as effects rather than HTTP answers."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, ClassVar

import httpx
import pytest

from payorch.core import downstream_key, namespace_ref
from payorch.provider import AnswerKind, SubmitRequest, VoidRequest, parse_deliveries
from payorch.providers.adyen import AdyenProvider
from payorch.testing import Emulator, Fault

if TYPE_CHECKING:
    from payorch.providers.adyen.emulator import AdyenEmulator

# The emulator's fixtures (adyen_emulator, adyen_provider); imported here by name only, so
# that pytest loads the module as a plugin.
pytest_plugins = ["adyen_emulator"]

TENANT = "tenant-a"


def request(
    emu: AdyenEmulator, operation: str = "payment.create", key: str = "k1", **over: Any
) -> SubmitRequest:
    return SubmitRequest(
        tenant_id=TENANT,
        operation=operation,
        operation_id=f"op-{key}",
        downstream_key=downstream_key(namespace_ref(TENANT, operation, key)),
        payload=emu.payload(operation, **over),
        idempotency_key=key,
    )


def void_of(submitted: SubmitRequest, reference: str | None = None) -> VoidRequest:
    return VoidRequest(
        tenant_id=TENANT,
        operation=submitted.operation,
        operation_id=submitted.operation_id,
        downstream_key=submitted.downstream_key,
        provider_reference=reference,
    )


def test_it_is_an_emulator_of_the_adapter_kit(adyen_emulator: AdyenEmulator) -> None:
    assert isinstance(adyen_emulator, Emulator)
    assert adyen_emulator.faults == frozenset(Fault) and adyen_emulator.batches


def test_a_payment_once_and_its_replay(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    sent = request(adyen_emulator)
    first = adyen_provider.submit(sent)
    assert first.kind is AnswerKind.SUCCEEDED and first.provider_reference
    again = adyen_provider.submit(sent)
    assert again == first  # the first answer, replayed under the key
    assert adyen_emulator.effects(sent.downstream_key) == 1


def test_another_body_under_the_key_is_ambiguous_and_makes_nothing(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    sent = request(adyen_emulator)
    adyen_provider.submit(sent)
    other = request(adyen_emulator, amount=999)
    answer = adyen_provider.submit(other)
    assert (answer.kind, answer.code, answer.status_code) == (AnswerKind.AMBIGUOUS, "704", 422)
    assert adyen_emulator.effects(sent.downstream_key) == 1


def test_a_concurrent_duplicate_meets_704(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    sent = request(adyen_emulator)
    answers: list[Any] = []
    with adyen_emulator.hold() as gate:
        first = threading.Thread(target=lambda: answers.append(adyen_provider.submit(sent)))
        first.start()
        assert gate.wait_held(5.0)
        with adyen_emulator.adapter() as second:
            duplicate = second.submit(sent)
        gate.release()
        first.join(10.0)
    assert not first.is_alive()
    assert (duplicate.kind, duplicate.code, duplicate.status_code) == (
        AnswerKind.AMBIGUOUS,
        "704",
        409,
    )
    assert answers[0].kind is AnswerKind.SUCCEEDED
    assert adyen_emulator.effects(sent.downstream_key) == 1


def test_an_answer_dropped_after_commit_is_ambiguous_and_one_effect(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    sent = request(adyen_emulator)
    adyen_emulator.inject(Fault.DROP_AFTER_COMMIT)
    assert adyen_provider.submit(sent).kind is AnswerKind.AMBIGUOUS
    assert adyen_emulator.effects(sent.downstream_key) == 1
    replay = adyen_provider.submit(sent)  # REPLAY: the identical request learns the outcome
    assert replay.kind is AnswerKind.SUCCEEDED
    assert adyen_emulator.effects(sent.downstream_key) == 1


@pytest.mark.parametrize(
    ("fault", "kind", "effects"),
    [
        (Fault.RATE_LIMITED, AnswerKind.NOT_SENT, 0),
        (Fault.IN_FLIGHT, AnswerKind.AMBIGUOUS, 0),
        (Fault.ERROR_BEFORE_COMMIT, AnswerKind.AMBIGUOUS, 0),
        (Fault.ERROR_AFTER_COMMIT, AnswerKind.AMBIGUOUS, 1),
        (Fault.DROP_AFTER_COMMIT, AnswerKind.AMBIGUOUS, 1),
        (Fault.DECLINE, AnswerKind.DECLINED, 0),
    ],
)
def test_every_fault(
    adyen_emulator: AdyenEmulator,
    adyen_provider: AdyenProvider,
    fault: Fault,
    kind: AnswerKind,
    effects: int,
) -> None:
    sent = request(adyen_emulator)
    adyen_emulator.inject(fault)
    assert adyen_provider.submit(sent).kind is kind
    assert adyen_emulator.effects(sent.downstream_key) == effects
    after = adyen_provider.submit(sent).kind  # the same key, with no fault
    assert after is (AnswerKind.DECLINED if fault is Fault.DECLINE else AnswerKind.SUCCEEDED)
    assert adyen_emulator.effects(sent.downstream_key) == (0 if fault is Fault.DECLINE else 1)


def test_a_cancel_by_reference_is_pending_then_a_technical_cancel(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    sent = request(adyen_emulator)
    adyen_emulator.inject(Fault.DROP_AFTER_COMMIT)
    assert adyen_provider.submit(sent).kind is AnswerKind.AMBIGUOUS  # its pspReference unknown
    answer = adyen_provider.void(void_of(sent))
    assert answer.kind is AnswerKind.PENDING
    assert adyen_emulator.voided(sent.downstream_key)
    (item,) = [i for i in adyen_emulator.notifications() if i["eventCode"] == "TECHNICAL_CANCEL"]
    event = adyen_provider.parse_webhook(*adyen_emulator.sign([item]))
    assert (event.outcome, event.code, event.lifecycle) == (AnswerKind.DECLINED, "voided", "voided")
    assert event.downstream_key == sent.downstream_key
    assert event.provider_reference == adyen_emulator.payments()[0]["psp"]
    assert adyen_provider.void(void_of(sent)) == answer  # the same void, replayed


def test_a_late_payment_under_a_voided_reference_is_refused(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    sent = request(adyen_emulator)
    assert adyen_provider.void(void_of(sent)).kind is AnswerKind.PENDING  # nothing to cancel yet
    late = adyen_provider.submit(sent)
    assert late.kind is AnswerKind.DECLINED
    assert adyen_emulator.effects(sent.downstream_key) == 0 and adyen_emulator.voided(
        sent.downstream_key
    )


def test_a_cancel_by_psp_reference_and_its_cancellation(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    sent = request(adyen_emulator)
    psp = adyen_provider.submit(sent).provider_reference
    answer = adyen_provider.void(void_of(sent, psp))
    assert (answer.kind, answer.provider_reference) == (AnswerKind.PENDING, psp)
    event = adyen_provider.parse_webhook(*adyen_emulator.sign(adyen_emulator.notifications()[-1:]))
    assert (event.event_type, event.outcome, event.downstream_key) == (
        "CANCELLATION",
        AnswerKind.DECLINED,
        sent.downstream_key,
    )
    assert adyen_emulator.voided(sent.downstream_key)


@pytest.mark.parametrize("operation", ["payment.capture", "refund.create"])
def test_a_modification_is_pending_and_its_notification_settles_it(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider, operation: str
) -> None:
    sent = request(adyen_emulator, operation)
    answer = adyen_provider.submit(sent)
    assert answer.kind is AnswerKind.PENDING
    event = adyen_provider.parse_webhook(*adyen_emulator.sign(adyen_emulator.notifications()[-1:]))
    assert event.outcome is AnswerKind.SUCCEEDED
    assert (event.downstream_key, event.provider_reference) == (
        sent.downstream_key,
        answer.provider_reference,
    )
    assert adyen_emulator.effects(sent.downstream_key) == 1


def test_a_delivery_with_a_tampered_item(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider
) -> None:
    keys = []
    for n in range(3):
        sent = request(adyen_emulator, key=f"k{n}")
        adyen_provider.submit(sent)
        keys.append(sent.downstream_key)
    batch = parse_deliveries(adyen_provider, *adyen_emulator.delivery(keys, tampered=[1]))
    assert [i.event is not None for i in batch.items] == [True, False, True]
    assert [i.event.downstream_key for i in batch.items if i.event] == [keys[0], keys[2]]


def test_requests_without_the_api_key_and_status_reads_are_refused(
    adyen_emulator: AdyenEmulator,
) -> None:
    with adyen_emulator.adapter(api_key="wrong") as wrong:
        answer = wrong.submit(request(adyen_emulator))
    assert (answer.kind, answer.code) == (AnswerKind.NOT_SENT, "provider_auth_failed")
    assert httpx.get(f"{adyen_emulator.url}/payments/ABC").status_code == 404
    assert (
        adyen_emulator.unreachable_adapter().submit(request(adyen_emulator)).kind
        is AnswerKind.NOT_SENT
    )


class _Receiver(BaseHTTPRequestHandler):
    """Answers 500 to its first delivery, then ``[accepted]``."""

    protocol_version = "HTTP/1.1"
    bodies: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        status, text = (500, b"no") if len(self.bodies) == 1 else (200, b"[accepted]")
        self.send_response(status)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[bytes]]]:
    _Receiver.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/adyen", _Receiver.bodies
    server.shutdown()
    server.server_close()


def test_notifications_are_posted_in_batches_until_accepted(
    adyen_emulator: AdyenEmulator, adyen_provider: AdyenProvider, receiver: tuple[str, list[bytes]]
) -> None:
    url, bodies = receiver
    for n in range(3):
        adyen_provider.submit(request(adyen_emulator, key=f"k{n}"))
    assert adyen_emulator.deliver(url, batch_size=2, max_attempts=3) == 3
    assert len(bodies) == 3  # the first batch twice (500, then accepted), the second once
    assert bodies[0] == bodies[1]
    assert [len(json.loads(b)["notificationItems"]) for b in bodies] == [2, 2, 1]
    for raw in bodies[1:]:
        assert all(i.event for i in adyen_provider.parse_webhooks({}, raw).items)
    assert adyen_emulator.deliver(url) == 0  # nothing left to send


def test_the_async_calls_against_the_emulator(adyen_emulator: AdyenEmulator) -> None:
    sent = request(adyen_emulator)

    async def run() -> list[Any]:
        async with adyen_emulator.adapter() as adapter:
            return [
                await adapter.asubmit(sent),
                await adapter.asubmit(sent),
                await adapter.avoid(void_of(sent)),
            ]

    first, again, voided = asyncio.run(run())
    assert first.kind is AnswerKind.SUCCEEDED and again == first
    assert voided.kind is AnswerKind.PENDING and adyen_emulator.voided(sent.downstream_key)
    assert adyen_emulator.effects(sent.downstream_key) == 1
