"""A Stripe-shaped API on loopback: :class:`StripeEmulator` (``payorch[stripe,testing]``).

A real HTTP server (``ThreadingHTTPServer`` in a thread, 127.0.0.1, an ephemeral port)
speaking what the adapter uses of Stripe's v1 API, form-encoded and Bearer-authorised:
PaymentIntents (create and confirm, retrieve, list, search by metadata, cancel, capture) and
Refunds (create, retrieve, list). A POST's ``Idempotency-Key`` acts as at Stripe: the same
key, method, path and parameters replay the first response (``Idempotent-Replayed: true``),
other parameters are a 400 ``idempotency_error``, a key still executing a 409
``idempotency_key_in_use``; validation errors are not saved under the key.

A ledger counts what each key's call authorised or moved. It is a
:class:`payorch.testing.Emulator`: faults for the next POST (never saved under the key: after
an error before commit the key runs afresh, after a commit the effect's answer is replayed),
adapters pointed at it or at a closed port, and deliveries signed as Stripe signs them
(``Stripe-Signature: t=<unix>,v1=<HMAC-SHA256 of "{t}.{body}" with the whsec_ secret>``).

Its ledger's money movements, written as Stripe's itemized settlement report
(:meth:`StripeEmulator.settlement_report`), are what ``payorch.recon`` imports.

Payment methods: ``pm_card_visa`` pays (or is authorised, with manual capture),
``pm_card_chargeDeclined`` and ``pm_card_chargeDeclinedInsufficientFunds`` decline (402).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx

from ...testing import Delivery, Fault
from ._adapter import StripeProvider
from ._emulator_http import API_ERROR, Reply, Server, new_id, reply_error

__all__ = ["API_KEY", "WEBHOOK_SECRET", "Gate", "StripeEmulator"]

API_KEY = "sk_test_emulator_51Hx"
WEBHOOK_SECRET = "whsec_emulator_5ZyGQ0lqYzbw0sNLDXNkKfd2"  # noqa: S105 - the emulator's own
_TIMEOUT = httpx.Timeout(connect=2.0, read=10.0, write=5.0, pool=2.0)
_HOLD_LIMIT = 10.0  # seconds a held request waits for its release at most
_CANCELABLE = frozenset(
    {"requires_payment_method", "requires_capture", "requires_confirmation", "requires_action"}
) | {"processing"}
_CANCEL_REASONS = frozenset({"duplicate", "fraudulent", "requested_by_customer", "abandoned"})
_DECLINING = {
    "pm_card_chargeDeclined": "generic_decline",
    "pm_card_chargeDeclinedInsufficientFunds": "insufficient_funds",
}
_NULL_INTENT_FIELDS: tuple[str, ...] = ("canceled_at", "cancellation_reason", "customer")
_NULL_INTENT_FIELDS += ("description", "last_payment_error", "latest_charge", "next_action")
_NULL_INTENT_FIELDS += ("payment_method",)
_SEARCH = re.compile(r"metadata\['((?:[^'\\]|\\.)*)'\]:'((?:[^'\\]|\\.)*)'")
_EVENTS = {
    "succeeded": "payment_intent.succeeded",
    "requires_capture": "payment_intent.amount_capturable_updated",
    "requires_payment_method": "payment_intent.payment_failed",
    "canceled": "payment_intent.canceled",
}


def _invalid(message: str, **fields: Any) -> Reply:
    return reply_error(400, "invalid_request_error", message, **fields)


def _in_use() -> Reply:
    message = "There is currently another in-progress request using this Idempotent Key."
    reply = reply_error(409, "idempotency_error", message, code="idempotency_key_in_use")
    reply.headers["Stripe-Should-Retry"] = "true"
    return reply


def _metadata(form: Mapping[str, str]) -> dict[str, str]:
    return {k[9:-1]: v for k, v in form.items() if k.startswith("metadata[") and k[-1] == "]"}


@dataclass
class Gate:
    """Holds keyed POSTs while executing (:meth:`StripeEmulator.hold`): ``entered`` is set
    when one is held, :meth:`release` lets them all go on."""

    entered: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


_Request = tuple[str, str, tuple[tuple[str, str], ...]]  # method, path, fields in order


class _Stripe:
    """The API's state and answers; every method is called with ``lock`` held."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.lock = threading.Lock()
        self.intents: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.created_by: dict[str, list[str]] = {}  # key -> intents its create made
        self.moved: dict[str, set[str]] = {}  # key -> objects its call authorised/moved
        self.saved: dict[str, tuple[_Request, Reply]] = {}
        self.in_flight: set[str] = set()
        self.faults: deque[Fault] = deque()
        self.gate: Gate | None = None
        self.log: list[dict[str, Any]] = []

    # -- dispatch ---------------------------------------------------------------------------

    def handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Reply:
        url = urlsplit(target)
        fields = parse_qsl(url.query if method == "GET" else body.decode(), keep_blank_values=True)
        key = headers.get("idempotency-key") if method == "POST" else None
        gate: Gate | None = None
        with self.lock:
            self.log.append(dict(method=method, path=url.path, idempotency_key=key, fields=fields))
            if headers.get("authorization") != f"Bearer {self.api_key}":
                return reply_error(401, "invalid_request_error", "Invalid API Key provided.")
            fault = self.faults.popleft() if method == "POST" and self.faults else None
            refused = self._refusal(fault)
            if refused is not None:
                return refused
            if method == "GET":
                return self._get(url.path, dict(fields))
            if key is not None:
                claimed = self._claim(key, (method, url.path, tuple(fields)))
                if claimed is not None:
                    return self._after(fault, claimed)
            gate = self.gate
        if key is not None and gate is not None:
            gate.entered.set()
            gate.released.wait(_HOLD_LIMIT)
        with self.lock:
            try:
                reply = self._post(url.path, dict(fields), key, decline=fault is Fault.DECLINE)
            finally:
                if key is not None:
                    self.in_flight.discard(key)
            if key is not None and reply.save:
                self.saved[key] = ((method, url.path, tuple(fields)), reply)
        return self._after(fault, reply)

    @staticmethod
    def _refusal(fault: Fault | None) -> Reply | None:
        if fault is Fault.RATE_LIMITED:
            return reply_error(
                429, "rate_limit_error", "Too many requests hit the API too quickly."
            )
        if fault is Fault.IN_FLIGHT:
            return _in_use()
        return reply_error(*API_ERROR) if fault is Fault.ERROR_BEFORE_COMMIT else None

    @staticmethod
    def _after(fault: Fault | None, reply: Reply) -> Reply:
        if fault is Fault.ERROR_AFTER_COMMIT:
            return reply_error(*API_ERROR)
        return Reply(500, {}, drop=True) if fault is Fault.DROP_AFTER_COMMIT else reply

    def _claim(self, key: str, request: _Request) -> Reply | None:
        """A reply owed under ``key`` already (a replay or a refusal), or None: run it."""
        if key in self.saved:
            first, reply = self.saved[key]
            if first == request:
                return Reply(reply.status, reply.body, {"Idempotent-Replayed": "true"})
            return reply_error(
                400,
                "idempotency_error",
                "Keys for idempotent requests can only be used with the same parameters they "
                f"were first used with. Try using a key other than '{key}' if you meant to "
                "execute a different request.",
            )
        if key in self.in_flight:
            return _in_use()
        self.in_flight.add(key)
        return None

    def _get(self, path: str, params: dict[str, str]) -> Reply:
        parts = path.strip("/").split("/")
        if path == "/v1/payment_intents/search":
            return self._search(params)
        if path in ("/v1/payment_intents", "/v1/refunds"):
            store = self.intents if path == "/v1/payment_intents" else self.refunds
            return self._list(path, store, params)
        if len(parts) == 3 and parts[1] == "payment_intents":
            return self._object(self.intents, parts[2], "payment_intent")
        if len(parts) == 3 and parts[1] == "refunds":
            return self._object(self.refunds, parts[2], "refund")
        return self._unknown("GET", path)

    def _post(self, path: str, form: dict[str, str], key: str | None, *, decline: bool) -> Reply:
        parts = path.strip("/").split("/")
        if path == "/v1/payment_intents":
            return self._create(form, key, decline=decline)
        if decline:
            return reply_error(402, "card_error", "Your card was declined.", code="card_declined")
        if path == "/v1/refunds":
            return self._refund(form, key)
        if len(parts) == 4 and parts[1] == "payment_intents" and parts[3] == "cancel":
            return self._cancel(parts[2], form)
        if len(parts) == 4 and parts[1] == "payment_intents" and parts[3] == "capture":
            return self._capture(parts[2], form, key)
        return self._unknown("POST", path)

    @staticmethod
    def _unknown(method: str, path: str) -> Reply:
        message = f"Unrecognized request URL ({method}: {path})."
        return reply_error(404, "invalid_request_error", message, save=False)

    # -- payment intents --------------------------------------------------------------------

    def _create(self, form: dict[str, str], key: str | None, *, decline: bool) -> Reply:
        amount, currency = form.get("amount", ""), form.get("currency", "")
        if not amount.isdigit() or int(amount) < 1 or not re.fullmatch(r"[a-z]{3}", currency):
            wrong = "amount" if not amount.isdigit() or int(amount) < 1 else "currency"
            return _invalid(f"Invalid {wrong}.", code="parameter_invalid", save=False)
        method = form.get("payment_method")
        given = {name: form.get(name) for name in ("customer", "description", "payment_method")}
        capture = form.get("capture_method", "automatic")
        pi = self.new_intent(amount=int(amount), currency=currency, capture_method=capture, **given)
        pi["metadata"] = _metadata(form)
        if key is not None:
            self.created_by.setdefault(key, []).append(pi["id"])
        if form.get("confirm") != "true" or method is None:
            pi["status"] = "requires_confirmation" if method else "requires_payment_method"
            return Reply(200, dict(pi))
        reason = "generic_decline" if decline else _DECLINING.get(method)
        if reason is not None:
            error = {"type": "card_error", "code": "card_declined", "decline_code": reason}
            pi["last_payment_error"] = error = error | {"message": "Your card was declined."}
            pi["latest_charge"] = new_id("ch")
            return Reply(402, {"error": {**error, "payment_intent": dict(pi)}})
        pi["latest_charge"] = new_id("ch")
        if pi["capture_method"] == "manual":
            pi.update(status="requires_capture", amount_capturable=pi["amount"])
        else:
            pi.update(status="succeeded", amount_received=pi["amount"])
        self._moved(key, pi["id"])
        return Reply(200, dict(pi))

    def new_intent(self, **fields: Any) -> dict[str, Any]:
        ident = new_id("pi")
        pi: dict[str, Any] = dict.fromkeys(_NULL_INTENT_FIELDS) | {"id": ident}
        pi |= {"object": "payment_intent", "created": int(time.time()), "livemode": False}
        pi |= {"amount": 0, "amount_capturable": 0, "amount_received": 0, "currency": "usd"}
        pi |= {"capture_method": "automatic", "confirmation_method": "automatic"}
        pi |= {"client_secret": f"{ident}_secret_{secrets.token_hex(8)}", "metadata": {}}
        pi |= {"payment_method_types": ["card"], "status": "requires_payment_method"}
        self.intents[ident] = pi | fields
        return self.intents[ident]

    def _moved(self, key: str | None, ident: str) -> None:
        if key is not None:
            self.moved.setdefault(key, set()).add(ident)

    def _unexpected(self, pi: dict[str, Any], action: str, allowed: Collection[str]) -> Reply:
        return _invalid(
            f"You cannot {action} this PaymentIntent because it has a status of "
            f"{pi['status']}. Only a PaymentIntent with one of the following statuses may be "
            f"{action}ed: {', '.join(sorted(allowed))}.",
            code="payment_intent_unexpected_state",
            payment_intent=dict(pi),
        )

    def _cancel(self, ident: str, form: dict[str, str]) -> Reply:
        if (pi := self.intents.get(ident)) is None:
            return self._missing("payment_intent", ident)
        reason = form.get("cancellation_reason")
        if reason is not None and reason not in _CANCEL_REASONS:
            return _invalid("Invalid cancellation_reason.")
        if pi["status"] not in _CANCELABLE:
            return self._unexpected(pi, "cancel", _CANCELABLE)
        pi.update(status="canceled", canceled_at=int(time.time()), amount_capturable=0)
        pi["cancellation_reason"] = reason
        return Reply(200, dict(pi))

    def _capture(self, ident: str, form: dict[str, str], key: str | None) -> Reply:
        if (pi := self.intents.get(ident)) is None:
            return self._missing("payment_intent", ident)
        if pi["status"] != "requires_capture":
            return self._unexpected(pi, "capture", ["requires_capture"])
        amount = int(form.get("amount_to_capture") or pi["amount_capturable"])
        if amount > pi["amount_capturable"]:
            return _invalid("Amount too large.", code="amount_too_large")
        pi.update(status="succeeded", amount_received=amount, amount_capturable=0)
        self._moved(key, ident)
        return Reply(200, dict(pi))

    # -- refunds ----------------------------------------------------------------------------

    def _refund(self, form: dict[str, str], key: str | None) -> Reply:
        if (pi := self.intents.get(form.get("payment_intent", ""))) is None:
            return self._missing("payment_intent", form.get("payment_intent", ""))
        if pi["status"] != "succeeded":
            return self._unexpected(pi, "refund", ["succeeded"])
        done = [r["amount"] for r in self.refunds.values() if r["payment_intent"] == pi["id"]]
        left = pi["amount_received"] - sum(done)
        amount = int(form.get("amount") or left)
        if left <= 0:
            return _invalid("Refunded already.", code="charge_already_refunded")
        if amount > left:
            return _invalid("Amount too large.", code="amount_too_large")
        refund: dict[str, Any] = {"id": new_id("re"), "object": "refund", "amount": amount}
        refund["status"] = "succeeded"
        refund |= {
            "charge": pi["latest_charge"],
            "currency": pi["currency"],
            "failure_reason": None,
        }
        refund |= {"created": int(time.time()), "payment_intent": pi["id"]}
        refund |= {"metadata": _metadata(form), "reason": form.get("reason")}
        self.refunds[refund["id"]] = refund
        self._moved(key, refund["id"])
        return Reply(200, dict(refund))

    # -- reads ------------------------------------------------------------------------------

    @staticmethod
    def _missing(kind: str, ident: str) -> Reply:
        message = f"No such {kind}: '{ident}'"
        return reply_error(404, "invalid_request_error", message, code="resource_missing")

    def _object(self, store: dict[str, dict[str, Any]], ident: str, kind: str) -> Reply:
        obj = store.get(ident)
        return Reply(200, dict(obj)) if obj is not None else self._missing(kind, ident)

    def _search(self, params: dict[str, str]) -> Reply:
        match = _SEARCH.fullmatch(params.get("query", "").strip())
        if match is None:
            return _invalid("Invalid search query.")
        name, value = (re.sub(r"\\(.)", r"\1", part) for part in match.groups())
        found = [pi for pi in self._newest(self.intents) if pi["metadata"].get(name) == value]
        page = self._page("/v1/payment_intents/search", found, params)
        return Reply(200, page.body | {"object": "search_result", "next_page": None})

    @staticmethod
    def _newest(store: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(reversed(store.values()), key=lambda o: -int(o["created"]))

    def _list(self, path: str, store: dict[str, dict[str, Any]], params: dict[str, str]) -> Reply:
        items = self._newest(store)
        bounds = {"gte": int.__ge__, "lte": int.__le__, "gt": int.__gt__, "lt": int.__lt__}
        for name, test in bounds.items():
            value = params.get(f"created[{name}]")
            if value is not None:
                items = [o for o in items if test(int(o["created"]), int(value))]
        if "payment_intent" in params:
            items = [o for o in items if o.get("payment_intent") == params["payment_intent"]]
        after = params.get("starting_after")
        if after is not None:
            ids = [o["id"] for o in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        return self._page(path, items, params)

    @staticmethod
    def _page(path: str, items: list[dict[str, Any]], params: Mapping[str, str]) -> Reply:
        limit = min(100, int(params.get("limit", "10")))
        data = [dict(o) for o in items[:limit]]
        return Reply(
            200, {"object": "list", "url": path, "has_more": len(items) > limit, "data": data}
        )


class StripeEmulator:
    """Stripe's API on loopback (the module docstring): ``with StripeEmulator() as e:``."""

    batches = False  # Stripe sends one event per delivery

    def __init__(self, *, api_key: str = API_KEY, webhook_secret: str = WEBHOOK_SECRET) -> None:
        self.api_key = api_key
        self.webhook_secret = webhook_secret
        self._stripe = _Stripe(api_key)
        self._server = Server(self._stripe)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        # Bound, never listening: a connect to it is refused, and no one else can take it.
        self._closed_port = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._closed_port.bind(("127.0.0.1", 0))
        self._adapters: list[StripeProvider] = []

    # -- life cycle -------------------------------------------------------------------------

    def __enter__(self) -> StripeEmulator:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Close the adapters it made, stop serving and cut every connection."""
        for adapter in self._adapters:
            adapter.close()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._closed_port.close()
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    # -- payorch.testing.Emulator -----------------------------------------------------------

    @property
    def faults(self) -> frozenset[Fault]:
        return frozenset(Fault)

    def adapter(self, **overrides: Any) -> StripeProvider:
        """A :class:`StripeProvider` on this emulator, closed when it stops."""
        settings: dict[str, Any] = {"api_key": self.api_key, "webhook_secret": self.webhook_secret}
        settings |= {"base_url": self.url, "timeout": _TIMEOUT}
        made = StripeProvider(**(settings | overrides))
        self._adapters.append(made)
        return made

    def unreachable_adapter(self) -> StripeProvider:
        port = self._closed_port.getsockname()[1]
        return self.adapter(base_url=f"http://127.0.0.1:{port}")

    def payload(self, operation: str, **overrides: Any) -> dict[str, Any]:
        """A valid payload; a capture or refund of a fresh intent made here (no key's
        effect) unless ``payment_intent`` is given."""
        if operation == "payment.create":
            return {"amount": 2000, "currency": "usd", "payment_method": "pm_card_visa"} | overrides
        if operation in ("payment.capture", "refund.create"):
            if "payment_intent" not in overrides:
                status = "requires_capture" if operation == "payment.capture" else "succeeded"
                overrides["payment_intent"] = self.seed_intent(status)["id"]
            return overrides
        raise ValueError(f"the Stripe emulator has no payload for {operation!r}")

    def inject(self, fault: Fault) -> None:
        """The next POST (of any kind) meets ``fault``; several queue up in order."""
        with self._stripe.lock:
            self._stripe.faults.append(Fault(fault))

    def effects(self, downstream_key: str) -> int:
        """Objects whose money the call under ``downstream_key`` authorised or moved (an
        intent authorised or paid, a capture, a refund): 1 after any number of replays; a
        declined intent is none."""
        with self._stripe.lock:
            return len(self._stripe.moved.get(downstream_key, ()))

    def voided(self, downstream_key: str) -> bool:
        """Whether the key's create made intents and every one of them is canceled."""
        intents = self.intents(downstream_key)
        return bool(intents) and all(pi["status"] == "canceled" for pi in intents)

    def delivery(
        self, downstream_keys: Sequence[str], *, tampered: Collection[int] = ()
    ) -> Delivery:
        """A signed event reporting the status of the intent the key's create made
        (``payment_intent.succeeded``, ``payment_failed``, ``canceled``…); with
        ``tampered={0}`` its body is altered after signing."""
        if len(downstream_keys) != 1:
            raise ValueError("Stripe sends one event per delivery")
        key = downstream_keys[0]
        intents = self.intents(key)
        if not intents:
            raise ValueError(f"no PaymentIntent was created under {key!r}")
        pi = intents[-1]
        event_type = _EVENTS.get(pi["status"])
        if event_type is None:
            raise ValueError(f"no event reports an intent in status {pi['status']!r}")
        stamp = str(int(time.time()))
        event: dict[str, Any] = {"id": new_id("evt"), "object": "event", "type": event_type}
        event["created"] = int(stamp)
        event |= {"api_version": "2024-06-20", "livemode": False, "pending_webhooks": 1}
        event |= {"data": {"object": pi}}
        event |= {"request": {"id": new_id("req"), "idempotency_key": key}}
        body = json.dumps(event, indent=2).encode()
        signed = stamp.encode() + b"." + body
        signature = hmac.new(self.webhook_secret.encode(), signed, hashlib.sha256).hexdigest()
        if 0 in tampered:
            event["data"]["object"] = pi | {"amount": pi["amount"] + 1}
            body = json.dumps(event, indent=2).encode()
        return {"Stripe-Signature": f"t={stamp},v1={signature}"}, body

    # -- more controls for tests ------------------------------------------------------------

    def intents(self, downstream_key: str) -> list[dict[str, Any]]:
        """Copies of the intents the create under ``downstream_key`` made, oldest first."""
        with self._stripe.lock:
            made = self._stripe.created_by.get(downstream_key, [])
            return [dict(self._stripe.intents[ident]) for ident in made]

    def seed_intent(self, status: str = "requires_capture", **fields: Any) -> dict[str, Any]:
        """An intent made here directly (no request, no key), e.g. to capture or refund."""
        with self._stripe.lock:
            held, paid = status == "requires_capture", status == "succeeded"
            pi: dict[str, Any] = {"status": status, "amount": 2000, "latest_charge": new_id("ch")}
            pi |= fields
            pi["capture_method"] = "manual" if held else "automatic"
            pi |= {"amount_capturable": pi["amount"] * held, "amount_received": pi["amount"] * paid}
            return dict(self._stripe.new_intent(**pi))

    def settlement_report(
        self,
        *,
        batch: str | int = "po_emulator_1",
        fee: Callable[[int], int] | None = None,
        effects: Collection[str] | None = None,
    ) -> bytes:
        """The ledger's money movements as Stripe's itemized report of one payout ``batch``
        (a number ``n`` is ``po_emulator_<n>``), rows named by the ids payorch stores (``pi_…``,
        ``re_…``): what ``payorch.recon`` imports. ``fee``: per captured amount; ``effects``:
        only these ids."""
        from ._emulator_report import settlement_report  # the report formats: only when asked

        with self._stripe.lock:
            intents = [dict(pi) for pi in self._stripe.intents.values()]
            refunds = [dict(r) for r in self._stripe.refunds.values()]
        return settlement_report(intents, refunds, batch=batch, fee=fee, effects=effects)

    def requests(self) -> list[dict[str, Any]]:
        """The requests received, oldest first: method, path, idempotency_key, fields."""
        with self._stripe.lock:
            return [dict(r) for r in self._stripe.log]

    @contextlib.contextmanager
    def hold(self) -> Iterator[Gate]:
        """Hold keyed POSTs after claiming their key, before executing, until released (a
        request under a held key meets 409 ``idempotency_key_in_use``)."""
        gate = Gate()
        with self._stripe.lock:
            self._stripe.gate = gate
        try:
            yield gate
        finally:
            gate.release()
            with self._stripe.lock:
                self._stripe.gate = None
