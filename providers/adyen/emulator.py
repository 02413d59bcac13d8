"""An Adyen-shaped emulator on loopback: :class:`AdyenEmulator`, a
:class:`payorch.testing.Emulator` (``payorch[adyen,testing]``).

A stdlib ``ThreadingHTTPServer`` speaking Checkout's shapes (``/payments``, its captures,
refunds and cancels, the standalone ``/cancels``): ``X-API-Key`` required, a ledger of effects
per ``Idempotency-Key`` (a repeat answers the first answer; another body under the key is a
422/704; a duplicate in flight a 409/704 with ``Transient-Error: true``), no status read, faults
on demand, and the notification items it would send, signed (:meth:`~AdyenEmulator.sign`,
:meth:`~AdyenEmulator.delivery`) or POSTed in batches until answered ``[accepted]``; its
money movements as Adyen's Settlement details report (:meth:`~AdyenEmulator.settlement_report`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import hmac
import itertools
import json
import secrets
import socket
import string
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, TypeGuard
from urllib.parse import urlsplit

import httpx

from ...testing import Delivery, Fault
from ._adapter import AdyenProvider
from ._emulator_books import Gate, Held, LedgerEffect, now
from ._emulator_http import Reply, Server, error
from ._notifications import SIGNED_FIELDS

__all__ = ["API_KEY", "HMAC_KEY", "MERCHANT", "AdyenEmulator", "Gate"]

API_KEY = "AQEyhmfxK4_test_emulator_key"
MERCHANT = "PayorchTestECOM"
# The official library's test key (its test vectors use it too).
HMAC_KEY = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
_RETURN_URL = "https://shop.invalid/checkout/return"
_VERSION = "v71"
_PSP_ALPHABET = string.ascii_uppercase + string.digits


class AdyenEmulator:
    """Adyen Checkout on loopback; ``with AdyenEmulator() as emu:`` serves on ``emu.url``."""

    def __init__(
        self,
        *,
        api_key: str = API_KEY,
        merchant_account: str = MERCHANT,
        hmac_key: str = HMAC_KEY,
        version: str = _VERSION,
    ) -> None:
        self.api_key = api_key
        self.merchant_account = merchant_account
        self.hmac_key = hmac_key
        self._key_bytes = bytes.fromhex(hmac_key)
        self._version = version
        self._lock = threading.Lock()
        self._keys: dict[str, Held] = {}
        self._effects: list[LedgerEffect] = []
        self._voided_refs: set[str] = set()
        self._items: list[dict[str, Any]] = []
        self._delivered: set[int] = set()  # indexes into _items
        self._faults: deque[Fault] = deque()
        self._gate: Gate | None = None
        self._seeds = itertools.count(1)
        self.received: list[dict[str, Any]] = []
        self.delivery_attempts = 0
        self._httpd: Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> AdyenEmulator:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._httpd is not None:
            raise RuntimeError("an AdyenEmulator starts once")
        self._httpd = Server(("127.0.0.1", 0), self)
        serve = self._httpd.serve_forever
        self._thread = threading.Thread(target=serve, args=(0.02,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        if self._gate is not None:
            self._gate.release()
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(5)

    @property
    def url(self) -> str:
        """The Checkout base URL, version included (what ``base_url`` takes)."""
        if self._httpd is None:
            raise RuntimeError("the emulator is not started")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/{self._version}"

    @property
    def faults(self) -> frozenset[Fault]:
        return frozenset(Fault)

    @property
    def batches(self) -> bool:
        return True

    def adapter(self, **overrides: Any) -> AdyenProvider:
        settings: dict[str, Any] = {
            "api_key": self.api_key,
            "merchant_account": self.merchant_account,
            "hmac_key": self.hmac_key,
            "base_url": self.url,
            "return_url": _RETURN_URL,
            "default_currency": "EUR",
            "timeout": httpx.Timeout(connect=2.0, read=5.0, write=2.0, pool=2.0),
        }
        settings.update(overrides)
        return AdyenProvider(**settings)

    def unreachable_adapter(self) -> AdyenProvider:
        with socket.socket() as probe:  # a port nothing listens on once it is closed
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return self.adapter(base_url=f"http://127.0.0.1:{port}/{self._version}")

    def payload(self, operation: str, **overrides: Any) -> dict[str, Any]:
        """A valid payload of payorch's built-in model for ``operation``; a capture or a
        refund comes with a payment made for it (authorised, resp. captured)."""
        if operation == "payment.create":
            base: dict[str, Any] = {"amount": 1000, "currency": "EUR", "customer": "shopper-17"}
            base.update(payment_method="8315012345678901", capture_method="manual")
        elif operation == "payment.capture":
            base = {"payment_intent": self.seed_payment(), "amount_to_capture": 1000}
        elif operation == "refund.create":
            psp = self.seed_payment(captured=True)
            base = {"payment_intent": psp, "amount": 500, "currency": "EUR"}
        else:
            raise ValueError(f"the Adyen emulator has no payload for {operation!r}")
        base.update(overrides)
        return base

    def inject(self, fault: Fault, times: int = 1) -> None:
        """The next ``times`` POSTs meet ``fault``."""
        with self._lock:
            self._faults.extend([Fault(fault)] * times)

    def effects(self, downstream_key: str) -> int:
        """Effects made under ``downstream_key`` (a refused payment is none)."""
        with self._lock:
            return sum(e.key == downstream_key and e.status != "refused" for e in self._effects)

    def voided(self, downstream_key: str) -> bool:
        """Whether the payment under ``downstream_key`` (its key or reference) was cancelled,
        or its reference was voided before any payment could use it."""
        with self._lock:
            key = downstream_key
            payments = [e for e in self._effects if key in (e.key, e.reference)]
            payments = [e for e in payments if e.kind == "payment"]
            if any(p.status == "cancelled" for p in payments):
                return True
            if any(p.status in ("authorised", "captured") for p in payments):
                return False
            return downstream_key in self._voided_refs

    def delivery(
        self, downstream_keys: Sequence[str], *, tampered: Collection[int] = ()
    ) -> Delivery:
        """One signed delivery of the AUTHORISATION items of each key's payment, in order;
        the items at ``tampered`` get another amount after signing."""
        with self._lock:
            items = []
            for key in downstream_keys:
                found = [i for i in self._items if i["merchantReference"] == key]
                found = [i for i in found if i["eventCode"] == "AUTHORISATION"]
                if not found:
                    raise LookupError(f"no payment was made under {key!r}")
                items.append(found[-1])
        return self.sign(items, tampered=tampered)

    def notifications(self) -> list[dict[str, Any]]:
        """Every notification item recorded, oldest first (unsigned copies)."""
        with self._lock:
            return [json.loads(json.dumps(i)) for i in self._items]

    def sign_item(self, item: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``item`` with its ``additionalData.hmacSignature``."""
        signed: dict[str, Any] = json.loads(json.dumps(item))
        amount = signed.get("amount") or {}
        values = {**signed, "value": amount.get("value"), "currency": amount.get("currency")}
        text = ":".join("" if values.get(n) is None else str(values[n]) for n in SIGNED_FIELDS)
        digest = hmac.new(self._key_bytes, text.encode("utf-8"), hashlib.sha256).digest()
        signed.setdefault("additionalData", {})["hmacSignature"] = base64.b64encode(digest).decode()
        return signed

    def sign(
        self, items: Sequence[Mapping[str, Any]], *, tampered: Collection[int] = ()
    ) -> Delivery:
        """A delivery of ``items``, each signed; those at ``tampered`` changed afterwards."""
        signed = [self.sign_item(i) for i in items]
        for index in tampered:
            signed[index]["amount"]["value"] += 1
        wrapped = [{"NotificationRequestItem": i} for i in signed]
        body = {"live": "false", "notificationItems": wrapped}
        return {"Content-Type": "application/json"}, json.dumps(body).encode()

    def deliver(self, url: str, *, batch_size: int = 10, max_attempts: int = 3) -> int:
        """POST every undelivered item to ``url`` (loopback only) in signed batches, each
        batch tried up to ``max_attempts`` times until answered 200 ``[accepted]``; the
        number of items accepted. A batch never accepted stays undelivered."""
        if urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the emulator only delivers to loopback URLs")
        with self._lock:
            pending = [i for i in range(len(self._items)) if i not in self._delivered]
            items = {i: self._items[i] for i in pending}
        accepted = 0
        with httpx.Client(timeout=5.0) as client:
            for start in range(0, len(pending), batch_size):
                batch = pending[start : start + batch_size]
                headers, body = self.sign([items[i] for i in batch])
                for _ in range(max_attempts):
                    self.delivery_attempts += 1
                    try:
                        reply = client.post(url, content=body, headers=dict(headers))
                    except httpx.HTTPError:
                        continue
                    if reply.status_code == 200 and reply.text.strip() == "[accepted]":
                        with self._lock:
                            self._delivered.update(batch)
                        accepted += len(batch)
                        break
        return accepted

    @contextlib.contextmanager
    def hold(self) -> Iterator[Gate]:
        """Hold the next POST in flight once it claimed its key, until released (or the
        block ends): a second request under the key meanwhile sees 409/704."""
        gate = Gate()
        with self._lock:
            self._gate = gate
        try:
            yield gate
        finally:
            gate.release()
            with self._lock:
                if self._gate is gate:
                    self._gate = None

    def seed_payment(self, *, captured: bool = False, amount: int = 1000) -> str:
        """A payment made directly in the ledger (no request, no notification)."""
        ref = f"emulator-seed-{next(self._seeds)}"
        money = {"value": amount, "currency": "EUR"}
        status, done = ("captured", amount) if captured else ("authorised", 0)
        with self._lock:
            psp = self._psp()
            self._effects.append(
                LedgerEffect("payment", psp, ref, ref, money, status, captured=done)
            )
        return psp

    def settlement_report(
        self,
        *,
        batch: str | int = 1,
        fee: Callable[[int], int] | None = None,
        effects: Collection[str] | None = None,
    ) -> bytes:
        """The ledger's money movements as Adyen's Settlement details report of batch number
        ``batch`` (what ``payorch.recon`` imports): a capture's row named by its payment's
        pspReference (and a separate capture's own), a refund's by its own. ``fee``: per
        captured amount; ``effects``: only the rows of these pspReferences."""
        from ._emulator_report import settlement_report  # the report formats: only when asked

        with self._lock:
            ledger = [dataclasses.replace(e) for e in self._effects]
            items = [dict(i) for i in self._items]
        return settlement_report(
            ledger,
            items,
            merchant_account=self.merchant_account,
            batch=batch,
            fee=fee,
            only=effects,
        )

    def payments(self) -> list[dict[str, Any]]:
        """The payments in the ledger (psp, key, reference, amount, status, ...)."""
        with self._lock:
            return [dataclasses.asdict(e) for e in self._effects if e.kind == "payment"]

    def _psp(self) -> str:
        return "".join(secrets.choice(_PSP_ALPHABET) for _ in range(16))

    def _record(self, effect: LedgerEffect, event: str, success: bool, **fields: Any) -> None:
        item: dict[str, Any] = {
            "additionalData": {},
            "amount": dict(effect.amount or {"value": 0, "currency": "EUR"}),
            "eventCode": event,
            "eventDate": now(),
            "merchantAccountCode": self.merchant_account,
            "merchantReference": effect.reference or "",
            "pspReference": effect.psp,
            "reason": "" if success else fields.pop("reason", "Refused"),
            "success": "true" if success else "false",
        }
        item.update({k: v for k, v in fields.items() if v is not None})
        self._items.append(item)

    def handle(self, method: str, path: str, headers: Mapping[str, str], raw: bytes) -> Reply:
        """One request as Checkout answers it (the HTTP handler's only call)."""
        self.received.append({"method": method, "path": path, "headers": dict(headers)})
        read = self._read(method, path, headers, raw)
        if isinstance(read, Reply):
            return read
        route, body = read
        with self._lock:
            fault = self._faults.popleft() if self._faults else None
        refused = _before_commit(fault)
        if refused is not None:
            return refused
        key = headers.get("idempotency-key")
        if key is not None:
            seen = self._claim(key, (route, body))
            if seen is not None:
                return seen
            with self._lock:
                gate, self._gate = self._gate, None
            if gate is not None:
                gate._hold()
        with self._lock:
            reply = self._route(route, body, key, decline=fault is Fault.DECLINE)
            if key is not None:
                reply.headers["Idempotency-Key"] = key
                self._keys[key].reply = reply
        if fault is Fault.ERROR_AFTER_COMMIT:
            return error(500, "000", "Internal error", "internal")
        if fault is Fault.DROP_AFTER_COMMIT:
            return Reply(status=0, body={}, drop=True)
        return reply

    def _read(
        self, method: str, path: str, headers: Mapping[str, str], raw: bytes
    ) -> tuple[str, dict[str, Any]] | Reply:
        """The route and the JSON object of an authorised POST, or the refusal."""
        prefix = f"/{self._version}"
        route = path[len(prefix) :] if path.startswith(prefix + "/") else None
        if method != "POST" or route is None:
            return error(404, "000", "Not Found", "internal")  # there is no status read
        if headers.get("x-api-key") != self.api_key:
            return error(401, "000", "HTTP Status Response - Unauthorized", "security")
        try:
            body = json.loads(raw)
        except ValueError:
            return error(400, "702", "Unexpected input: the body is not JSON")
        if not isinstance(body, dict):
            return error(400, "702", "Unexpected input: expected an object")
        return route, body

    def _claim(self, key: str, request: tuple[str, Any]) -> Reply | None:
        with self._lock:
            held = self._keys.get(key)
            if held is None:
                self._keys[key] = Held(request=request)
                return None
            if held.request != request:
                return error(422, "704", "request already processed or in progress")
            if held.reply is None:
                return _in_flight()
            return held.reply

    def _route(self, route: str, body: dict[str, Any], key: str | None, decline: bool) -> Reply:
        if body.get("merchantAccount") != self.merchant_account:
            return error(403, "901", "Invalid Merchant Account", "security")
        parts = route.strip("/").split("/")
        if parts == ["payments"]:
            return self._payment(body, key, decline)
        if parts == ["cancels"]:
            return self._technical_cancel(body, key)
        if len(parts) == 3 and parts[0] == "payments":
            if decline:
                return error(422, "000", "Modification refused (injected decline)")
            if parts[2] in ("captures", "refunds", "cancels"):
                return self._modification(parts[2], parts[1], body, key)
        return error(404, "000", "Not Found", "internal")

    def _payment(self, body: dict[str, Any], key: str | None, decline: bool) -> Reply:
        amount = body.get("amount")
        reference = body.get("reference")
        method = body.get("paymentMethod")
        if not _valid_amount(amount):
            return error(422, "137", "Invalid amount specified")
        if not isinstance(reference, str) or not 0 < len(reference) <= 80:
            return error(422, "130", "Reference Missing")
        if not isinstance(method, dict) or not isinstance(method.get("type"), str):
            return error(422, "14_004", "Missing payment method details")
        if not isinstance(body.get("returnUrl"), str):
            return error(422, "14_030", "Return URL is missing.")
        metadata = body.get("metadata") or {}  # Adyen's limits: 20 entries, 20 and 80 chars
        if len(metadata) > 20 or any(len(k) > 20 or len(str(v)) > 80 for k, v in metadata.items()):
            return error(422, "177", "Metadata size exceeds limit")
        manual = (body.get("additionalData") or {}).get("manualCapture") == "true"
        voided = reference in self._voided_refs
        refused = decline or voided
        status = "refused" if refused else ("authorised" if manual else "captured")
        captured = 0 if refused or manual else amount["value"]
        effect = LedgerEffect("payment", self._psp(), key, reference, dict(amount), status)
        effect.captured = captured
        self._effects.append(effect)
        reply: dict[str, Any] = {"pspReference": effect.psp, "merchantReference": reference}
        reply["amount"] = dict(amount)
        if refused:
            reason = "Transaction cancelled" if voided else "Refused"
            reply.update(resultCode="Refused", refusalReason=reason, refusalReasonCode="2")
            self._record(effect, "AUTHORISATION", False, reason=reason)
        else:
            reply.update(resultCode="Authorised", additionalData={"authCode": "044925"})
            self._record(effect, "AUTHORISATION", True, operations=["CANCEL", "CAPTURE", "REFUND"])
        return Reply(status=200, body=reply)

    def _modification(self, kind: str, psp: str, body: dict[str, Any], key: str | None) -> Reply:
        payment = next((e for e in self._effects if e.kind == "payment" and e.psp == psp), None)
        if payment is None:
            return error(422, "167", "Original pspReference required for this operation")
        amount = body.get("amount", payment.amount) if kind == "cancels" else body.get("amount")
        if not _valid_amount(amount):
            return error(422, "137", "Invalid amount specified")
        reference = body.get("reference")
        reference = reference if isinstance(reference, str) else payment.reference
        effect = LedgerEffect(kind.removesuffix("s"), self._psp(), key, reference, dict(amount))
        effect.payment = psp
        self._effects.append(effect)
        success, reason = self._apply(kind, payment, amount)
        event = {"captures": "CAPTURE", "refunds": "REFUND", "cancels": "CANCELLATION"}[kind]
        self._record(effect, event, success, reason=reason, originalReference=psp)
        reply: dict[str, Any] = {"merchantAccount": self.merchant_account}
        reply.update(paymentPspReference=psp, pspReference=effect.psp, status="received")
        reply["reference"] = reference or ""
        if kind != "cancels":
            reply["amount"] = dict(amount)
        return Reply(status=201, body=reply)

    def _apply(self, kind: str, payment: LedgerEffect, amount: dict[str, Any]) -> tuple[bool, str]:
        fits = (payment.amount or {}).get("currency") == amount["currency"]
        value = amount["value"]
        if kind == "refunds":
            if payment.status != "captured":
                return False, "Transaction hasn't been captured, refund not possible"
            if not fits or payment.refunded + value > payment.captured:
                return False, "Insufficient balance on payment"
            payment.refunded += value
            return True, ""
        if payment.status != "authorised":
            return False, f"Payment is {payment.status}"
        if kind == "captures" and (not fits or value > (payment.amount or {}).get("value", 0)):
            return False, "Insufficient balance on payment"
        payment.status = "captured" if kind == "captures" else "cancelled"
        payment.captured = value if kind == "captures" else 0
        return True, ""

    def _technical_cancel(self, body: dict[str, Any], key: str | None) -> Reply:
        reference = body.get("paymentReference")
        if not isinstance(reference, str) or not reference:
            return error(422, "14_000", "Missing paymentReference")
        self._voided_refs.add(reference)
        payments = [e for e in self._effects if e.kind == "payment" and e.reference == reference]
        live = [p for p in payments if p.status in ("authorised", "captured")]
        target = live[-1] if live else (payments[-1] if payments else None)
        success, reason = True, ""
        if target is not None and target.status == "captured":
            success, reason = False, "Payment already captured"
        elif target is not None and target.status == "authorised":
            target.status = "cancelled"
        # The notification names the original payment's reference (and its pspReference).
        original = target.psp if target else None
        money = dict(target.amount or {}) if target else {"value": 0, "currency": "EUR"}
        cancel = LedgerEffect(
            "technical_cancel", self._psp(), key, reference, money, payment=original
        )
        self._effects.append(cancel)
        self._record(cancel, "TECHNICAL_CANCEL", success, reason=reason, originalReference=original)
        reply = {"merchantAccount": self.merchant_account, "paymentReference": reference}
        reply.update(pspReference=cancel.psp, status="received")
        if isinstance(body.get("reference"), str):
            reply["reference"] = body["reference"]
        return Reply(status=201, body=reply)


def _valid_amount(amount: object) -> TypeGuard[dict[str, Any]]:
    value = amount.get("value") if isinstance(amount, dict) else None
    currency = amount.get("currency") if isinstance(amount, dict) else None
    ok_value = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return ok_value and isinstance(currency, str) and len(currency) == 3


def _before_commit(fault: Fault | None) -> Reply | None:
    """The answer of a fault that refuses before anything is done, or None."""
    if fault is Fault.RATE_LIMITED:
        return error(429, "429", "Too many requests", "internal", Retry_After="1")
    if fault is Fault.IN_FLIGHT:
        return _in_flight()
    if fault is Fault.ERROR_BEFORE_COMMIT:
        return error(500, "000", "Internal error", "internal")
    return None


def _in_flight() -> Reply:
    return error(409, "704", "request already processed or in progress", Transient_Error="true")
