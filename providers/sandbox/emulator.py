"""The sandbox acquirer as the adapter kit's :class:`payorch.testing.Emulator`
(``payorch[testing]``): :class:`SandboxEmulator`, or :func:`running` for one on loopback.

The real :class:`SandboxServer` on loopback: its ledger counts the effects, its fault queue
injects the faults, its outbox signs the webhooks. Two faults need a little staging:

- ``drop_after_commit`` is the sandbox's ``reset_after``: the effect committed, then the
  connection closed unanswered (no time-out to wait out);
- ``in_flight`` puts a first request with the same key and body in flight for real: held
  by the server's commit gate after it claimed the key, while the adapter's request meets
  the server's ``request_in_progress``; that first request then commits a decline (its
  ``X-Sandbox-Fault`` header, not part of the body the key is bound to), so no money moves.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import httpx

from ...testing import Delivery, Fault
from ._adapter import SandboxProvider
from ._faults import Fault as SandboxFault
from ._server import SandboxServer

__all__ = ["SandboxEmulator", "running"]

_TIMEOUT = httpx.Timeout(connect=2.0, read=5.0, write=5.0, pool=2.0)
_HELD_WAIT = 5.0  # seconds to see the first request held at the gate
_QUEUED = {
    Fault.RATE_LIMITED: SandboxFault.RATE_LIMIT,
    Fault.ERROR_BEFORE_COMMIT: SandboxFault.ERROR_500_BEFORE,
    Fault.ERROR_AFTER_COMMIT: SandboxFault.ERROR_500_AFTER,
    Fault.DROP_AFTER_COMMIT: SandboxFault.RESET_AFTER,
    Fault.DECLINE: SandboxFault.DECLINE,
}
_MONEY = frozenset({"succeeded", "processing", "voided"})  # a voided one was authorised


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class _Staging(httpx.HTTPTransport):
    """The adapter's transport: passes everything on, staging an armed ``in_flight``."""

    def __init__(self, emulator: SandboxEmulator) -> None:
        super().__init__()
        self._emulator = emulator

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and self._emulator.take_in_flight():
            return self._emulator.in_flight(request, super().handle_request)
        return super().handle_request(request)


class SandboxEmulator:
    """An :class:`~payorch.testing.Emulator` over a running :class:`SandboxServer`."""

    def __init__(self, server: SandboxServer) -> None:
        self.server = server
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def faults(self) -> frozenset[Fault]:
        return frozenset(Fault)

    @property
    def batches(self) -> bool:
        return False

    def adapter(self) -> SandboxProvider:
        return SandboxProvider(
            base_url=self.server.url,
            webhook_secret=self.server.webhook_secret,
            timeout=_TIMEOUT,
            transport=_Staging(self),
        )

    def unreachable_adapter(self) -> SandboxProvider:
        return SandboxProvider(
            base_url=f"http://127.0.0.1:{_closed_port()}",
            webhook_secret=self.server.webhook_secret,
            timeout=_TIMEOUT,
        )

    def payload(self, operation: str, **overrides: Any) -> dict[str, Any]:
        if operation != "payment.create":
            raise ValueError(f"the sandbox emulator builds payment.create, not {operation!r}")
        body: dict[str, Any] = {
            "amount": 1250,
            "currency": "EUR",
            "customer": "cus_kit",
            "payment_method": "pm_card_visa",
        }
        body.update(overrides)
        return body

    def inject(self, fault: Fault) -> None:
        if fault is Fault.IN_FLIGHT:
            with self._lock:
                self._in_flight += 1
            return
        self.server.inject(_QUEUED[fault])

    def effects(self, downstream_key: str) -> int:
        return sum(1 for e in self._entries(downstream_key) if e["status"] in _MONEY)

    def voided(self, downstream_key: str) -> bool:
        return any(e["status"] == "voided" for e in self._entries(downstream_key))

    def delivery(
        self, downstream_keys: Sequence[str], *, tampered: Collection[int] = ()
    ) -> Delivery:
        if len(downstream_keys) != 1:
            raise ValueError("the sandbox sends one event per delivery")
        [key] = downstream_keys
        sent = [
            d
            for d in self.server.webhook_deliveries()
            if json.loads(d.body)["data"].get("idempotency_key") == key
        ]
        if not sent:
            raise LookupError(f"the sandbox sent no event for {key}")
        latest = sent[-1]  # the effect as it stands
        body = latest.body
        if 0 in tampered:
            event = json.loads(body)
            event["data"]["amount"] = int(event["data"].get("amount") or 0) + 1
            body = json.dumps(event, separators=(",", ":"), sort_keys=True).encode()
        headers: Mapping[str, str] = dict(latest.headers)
        return headers, body

    # -- in_flight staging ----------------------------------------------------------------

    def take_in_flight(self) -> bool:
        with self._lock:
            if self._in_flight == 0:
                return False
            self._in_flight -= 1
            return True

    def in_flight(self, request: httpx.Request, forward: Any) -> httpx.Response:
        """``request`` sent while a first one with its key and body is held in flight."""
        first_answer: list[int] = []

        def first() -> None:
            with httpx.Client(timeout=_TIMEOUT) as client:
                response = client.post(
                    str(request.url),
                    content=request.read(),
                    headers={
                        "Content-Type": "application/json",
                        "Idempotency-Key": request.headers["idempotency-key"],
                        "X-Sandbox-Fault": SandboxFault.DECLINE.value,
                    },
                )
                first_answer.append(response.status_code)

        with self.server.hold_commits() as gate:
            holder = threading.Thread(target=first, name="kit-in-flight", daemon=True)
            holder.start()
            if not gate.wait_held(1, timeout=_HELD_WAIT):
                raise RuntimeError("the first request was not held in flight")
            raw = forward(request)
            try:
                content = raw.read()
            finally:
                raw.close()
        holder.join(_HELD_WAIT)
        if first_answer != [402]:
            raise RuntimeError(f"the request held in flight answered {first_answer}")
        return httpx.Response(
            raw.status_code, headers=raw.headers, content=content, request=request
        )

    def _entries(self, key: str) -> list[dict[str, Any]]:
        return [e for e in self.server.ledger() if e["idempotency_key"] == key]


@contextlib.contextmanager
def running() -> Iterator[SandboxEmulator]:
    """A sandbox on loopback for the length of the block, as an emulator."""
    with SandboxServer() as server:
        yield SandboxEmulator(server)
