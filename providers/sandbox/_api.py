"""What the sandbox acquirer answers, independent of sockets: routes, idempotency, faults.

Decisions worth knowing:

- Idempotency keys are scoped to the whole server (like Stripe's account scope); the
  fingerprint is the canonical JSON of the operation name and the body, so one key used for
  another operation or another body is ``idempotency_key_reused``.
- A second request with a key whose first request is still executing gets 409
  ``request_in_progress`` with Retry-After at once (Stripe's behaviour) instead of waiting:
  a waiting handler could be stuck behind a slow first request for no benefit.
- Faults after commit (``error_500_after``, ``drop_after``, ``reset_after``, ``trickle``)
  model a failure on the way back: the stored response is the real one (200 or 402), so a
  retry with the same key replays the effect. They apply to replays too; faults that shape
  the effect (``decline``, ``pending``) do not, as the stored answer wins.
- ``rate_limit`` and ``error_500_before`` act before the idempotency store: nothing stored.
- ``GET /v1/effects`` pages like Stripe's lists when asked to (``created[gte]``,
  ``created[lte]``, ``limit``, ``starting_after``; ``has_more``), in commit order: what
  ``payorch effects unexplained`` reads. Without those parameters it lists everything.
- GETs honour the ``X-Sandbox-Fault`` header too (``decline`` and ``pending`` are ignored
  there); the queue and the rates only apply to POST /v1/operations.
- The base latency (fixed plus jitter) delays every API request before anything else, the
  header's fault included; the control routes (:mod:`payorch.providers.sandbox._admin`) and
  ``GET /v1/ledger`` (what tests count) answer at once.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ._admin import handle_admin, is_admin
from ._faults import AFTER_COMMIT, BEFORE_COMMIT, WIRE_FAULTS, Fault, FaultPlan, parse_fault
from ._ledger import Claim, Clock, EffectStatus, IdempotencyStore, Ledger, VoidResult
from ._webhooks import Outbox

__all__ = ["Acquirer", "CommitGate", "Reply"]

MAX_KEY_LENGTH = 255
MAX_PAGE = 100  # effects per page of a paged listing, as Stripe's lists
_PAGING = frozenset({"created[gte]", "created[lte]", "limit", "starting_after"})
DECLINED_PAYMENT_METHOD = "pm_card_declined"
GATE_LIMIT = 30.0  # seconds a held request waits at most for CommitGate.release()
_OPERATION = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    wire: Fault | None = None  # DROP_AFTER / RESET_AFTER / TRICKLE: how to (not) answer


def _json(status: int, obj: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> Reply:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return Reply(status=status, body=body, headers=dict(headers or {}))


def error_reply(status: int, type_: str, code: str | None = None, **extra: Any) -> Reply:
    error: dict[str, Any] = {"type": type_}
    if code is not None:
        error["code"] = code
    error.update(extra)
    return _json(status, {"error": error})


class CommitGate:
    """Holds new POSTs after they claimed their key, before they commit (for tests).

    Lets a test put a request "in flight" deterministically: wait for ``wait_held``, act,
    then ``release``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = 0
        self._open = False

    def wait_held(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until ``count`` requests are held; False on time-out."""
        with self._cond:
            return self._cond.wait_for(lambda: self._held >= count, timeout)

    def release(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def pass_through(self) -> None:
        with self._cond:
            self._held += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._open, GATE_LIMIT)


class Acquirer:
    """The acquirer's state and behaviour; thread-safe, called from connection threads."""

    def __init__(
        self,
        *,
        clock: Clock,
        faults: FaultPlan,
        outbox: Outbox,
        window: float,
        lag: float,
        settle_after: float,
        retry_after: str,
        drop_hold: float,
        stop: threading.Event,
        trickle_interval: float = 0.05,
    ) -> None:
        self.clock = clock
        self.faults = faults
        self.outbox = outbox
        self.ledger = Ledger(clock, settle_after=settle_after, on_change=outbox.emit)
        self._idempotency = IdempotencyStore(clock, window=window)
        self._lag = lag
        self._retry_after = retry_after
        self._drop_hold = drop_hold
        self._trickle_interval = trickle_interval
        self._stop = stop
        self._gate_lock = threading.Lock()
        self._gate: CommitGate | None = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def hold_response(self) -> None:
        """Keep a dropped response's connection open; stop() ends the wait early."""
        self._stop.wait(self._drop_hold)

    def trickle_pause(self) -> bool:
        """Wait between two trickled bytes; True if the server is stopping (give up)."""
        return self._stop.wait(self._trickle_interval)

    @contextlib.contextmanager
    def hold_commits(self) -> Iterator[CommitGate]:
        gate = CommitGate()
        with self._gate_lock:
            if self._gate is not None:
                raise RuntimeError("commits are already held")
            self._gate = gate
        try:
            yield gate
        finally:
            with self._gate_lock:
                self._gate = None
            gate.release()

    def release_gate(self) -> None:
        with self._gate_lock:
            gate = self._gate
        if gate is not None:
            gate.release()

    # -- routing ---------------------------------------------------------------------------

    def handle(  # noqa: PLR0911 - one return per route
        self, method: str, target: str, headers: Mapping[str, str], body: bytes
    ) -> Reply:
        """Answer one request; ``headers`` have lower-case names."""
        parts = urlsplit(target)
        path = parts.path.rstrip("/")
        if is_admin(path):
            return _json(*handle_admin(self, method, path, body))
        # GET /v1/ledger is the tests' view of the truth, not the acquirer's API: no delay.
        delay = self.faults.request_delay() if path != "/v1/ledger" else 0.0
        if delay and self._stop.wait(delay):  # stop() ends the wait: nothing was done
            return error_reply(503, "api_error", "shutting_down")
        forced: Fault | None = None
        fault_header = headers.get("x-sandbox-fault")
        if fault_header is not None:
            try:
                forced = parse_fault(fault_header)
            except ValueError as exc:
                return error_reply(400, "invalid_request_error", "unknown_fault", message=str(exc))
        if path == "/v1/voids":
            if method != "POST":
                return error_reply(405, "invalid_request_error", "method_not_allowed")
            return self._post_void(body, forced)
        if path.startswith("/v1/operations/"):
            if method != "POST":
                return error_reply(405, "invalid_request_error", "method_not_allowed")
            operation = unquote(path.removeprefix("/v1/operations/"))
            return self._post_operation(operation, headers.get("idempotency-key"), body, forced)
        if method != "GET":
            return error_reply(405, "invalid_request_error", "method_not_allowed")
        early = self._forced_before(forced)
        if early is not None:
            return early
        wire = forced if forced in WIRE_FAULTS else None
        return replace(self._get(path, parse_qs(parts.query)), wire=wire)

    def _get(self, path: str, query: Mapping[str, list[str]]) -> Reply:
        if path == "/v1/ledger":
            return _json(200, {"data": self.ledger.entries()})
        if path == "/v1/effects" and _PAGING.intersection(query):
            return self._list_page(query)
        if path == "/v1/effects":
            # No filter lists every visible effect; each filter narrows (AND).
            data = self.ledger.search(
                lag=self._lag,
                idempotency_keys=query.get("idempotency_key"),
                refs=query.get("payorch_ref"),
            )
            return _json(200, {"data": data})
        if path.startswith("/v1/effects/"):
            effect = self.ledger.get(unquote(path.removeprefix("/v1/effects/")), lag=self._lag)
            if effect is None:
                return error_reply(404, "invalid_request_error", "resource_missing")
            return _json(200, effect)
        return error_reply(404, "invalid_request_error", "unknown_route")

    def _list_page(self, query: Mapping[str, list[str]]) -> Reply:
        """``/v1/effects`` paged as Stripe's lists are: ``created[gte]``, ``created[lte]``
        (Unix seconds), ``limit`` (1-100, default 10) and ``starting_after`` (an effect id);
        the answer says ``has_more``."""
        values: dict[str, int] = {}
        for name, low, high in (
            ("created[gte]", 0, None),
            ("created[lte]", 0, None),
            ("limit", 1, MAX_PAGE),
        ):
            given = query.get(name)
            if given is None:
                continue
            try:
                value = int(given[-1])
            except ValueError:
                value = -1
            if value < low or (high is not None and value > high):
                return error_reply(400, "invalid_request_error", "parameter_invalid", param=name)
            values[name] = value
        after = query.get("starting_after")
        try:
            data, more = self.ledger.listing(
                lag=self._lag,
                created_gte=values.get("created[gte]"),
                created_lte=values.get("created[lte]"),
                limit=values.get("limit", 10),
                starting_after=after[-1] if after else None,
            )
        except KeyError:
            return error_reply(
                400, "invalid_request_error", "resource_missing", param="starting_after"
            )
        return _json(200, {"object": "list", "data": data, "has_more": more})

    # -- POST /v1/operations/{operation} ---------------------------------------------------

    def _post_operation(
        self, operation: str, key: str | None, raw: bytes, forced: Fault | None
    ) -> Reply:
        if not key or len(key) > MAX_KEY_LENGTH:
            code = "missing_idempotency_key" if not key else "idempotency_key_too_long"
            return error_reply(400, "invalid_request_error", code)
        payload = self._parse_payload(operation, raw)
        if isinstance(payload, Reply):
            return payload
        fault = self.faults.next_for_post(forced)
        if fault is Fault.LATENCY or fault in BEFORE_COMMIT:
            early = self._fault_before(fault)
            if early is not None:
                return early
        return self._execute_once(operation, key, payload, fault)

    def _post_void(self, raw: bytes, forced: Fault | None) -> Reply:
        """``POST /v1/voids {"idempotency_key": …}``: void what that key authorised (by key,
        as Square cancels a payment by its CreatePayment's key). Naturally idempotent."""
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        key = payload.get("idempotency_key") if isinstance(payload, dict) else None
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
            return error_reply(
                400, "invalid_request_error", "parameter_invalid", param="idempotency_key"
            )
        early = self._forced_before(forced)
        if early is not None:
            return early
        if self._idempotency.in_flight(key):
            reply = error_reply(409, "idempotency_error", "request_in_progress")
            return replace(reply, headers={"Retry-After": self._retry_after})
        result, effect = self.ledger.void(key)
        if result is VoidResult.ALREADY_CAPTURED:
            return error_reply(400, "invalid_request_error", "already_captured", effect=effect)
        reply = _json(200, {"object": "void", "status": result.value, "effect": effect})
        return self._fault_after(reply, forced)

    @staticmethod
    def _parse_payload(operation: str, raw: bytes) -> dict[str, Any] | Reply:
        """The request's JSON object, or the 4xx that refuses it."""
        if not _OPERATION.fullmatch(operation):
            return error_reply(404, "invalid_request_error", "unknown_operation")
        try:
            payload = json.loads(raw)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            return error_reply(400, "invalid_request_error", "invalid_json")
        if not isinstance(payload, dict):
            return error_reply(400, "invalid_request_error", "invalid_json")
        if not isinstance(payload.get("metadata", {}), dict):
            return error_reply(400, "invalid_request_error", "parameter_invalid", param="metadata")
        return payload

    def _forced_before(self, forced: Fault | None) -> Reply | None:
        """The answer of a fault forced by header that acts before any work (a decline or a
        pending outcome only means something for a payment), or None to go on."""
        if forced is None or forced in (Fault.DECLINE, Fault.PENDING):
            return None
        return self._fault_before(forced)

    def _fault_before(self, fault: Fault) -> Reply | None:
        """The answer of a fault that acts before any work, or None to go on."""
        if fault is Fault.LATENCY:
            if self._stop.wait(self.faults.latency_seconds()):
                return error_reply(503, "api_error", "shutting_down")
        elif fault is Fault.RATE_LIMIT:
            reply = error_reply(429, "rate_limit_error", "rate_limited")
            return replace(reply, headers={"Retry-After": self._retry_after})
        elif fault in (Fault.ERROR_500_BEFORE, Fault.ERROR_500_AFTER):
            return error_reply(500, "api_error")
        return None

    def _execute_once(
        self, operation: str, key: str, payload: dict[str, Any], fault: Fault | None
    ) -> Reply:
        """Replay, refuse or execute under the idempotency key."""
        fingerprint = json.dumps(
            {"operation": operation, "body": payload}, sort_keys=True, separators=(",", ":")
        )
        claim, stored = self._idempotency.claim(key, fingerprint)
        if claim is Claim.MISMATCH:
            return error_reply(400, "idempotency_error", "idempotency_key_reused")
        if claim is Claim.IN_PROGRESS:
            reply = error_reply(409, "idempotency_error", "request_in_progress")
            return replace(reply, headers={"Retry-After": self._retry_after})
        if stored is not None:  # Claim.REPLAY
            replayed = Reply(stored.status, stored.body, {"Idempotent-Replayed": "true"})
            return self._fault_after(replayed, fault)
        committed = False
        try:
            reply = self._execute(operation, key, payload, fault)
            committed = reply.status in (200, 402)
            if committed:
                self._idempotency.complete(key, fingerprint, reply.status, reply.body)
        finally:
            if not committed:
                self._idempotency.release(key)  # only committed answers are replayed
        return self._fault_after(reply, fault) if committed else reply

    def _execute(
        self, operation: str, key: str, payload: dict[str, Any], fault: Fault | None
    ) -> Reply:
        with self._gate_lock:
            gate = self._gate
        if gate is not None:
            gate.pass_through()
        if self._stop.is_set():
            return error_reply(503, "api_error", "shutting_down")
        if fault is Fault.DECLINE or payload.get("payment_method") == DECLINED_PAYMENT_METHOD:
            status = EffectStatus.DECLINED
        elif fault is Fault.PENDING:
            status = EffectStatus.PROCESSING
        else:
            status = EffectStatus.SUCCEEDED
        effect = self.ledger.commit(
            operation=operation, idempotency_key=key, payload=payload, status=status
        )
        if effect is None:  # the key was voided before this request: nothing can be made
            return error_reply(
                402,
                "card_error",
                "voided",
                decline_code="voided",
                message="This payment was voided before it was made.",
            )
        if status is EffectStatus.DECLINED:
            return error_reply(
                402,
                "card_error",
                "card_declined",
                decline_code="generic_decline",
                effect_id=effect["id"],
                message="Your card was declined.",
            )
        return _json(200, effect)

    @staticmethod
    def _fault_after(reply: Reply, fault: Fault | None) -> Reply:
        if fault is Fault.ERROR_500_AFTER:
            return error_reply(500, "api_error")
        if fault in AFTER_COMMIT:
            return replace(reply, wire=fault)
        return reply
