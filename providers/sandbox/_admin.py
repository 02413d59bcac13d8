"""The sandbox's own control routes, for an operator or a test driving a running server.

``GET /healthz`` answers 200 once the server listens. Under ``/sandbox/``: the fault queue
(``GET``, ``POST {"fault", "times"}``, ``DELETE``), settling a "processing" effect now
(``POST /sandbox/effects/{id}/settle {"outcome"}``), the webhook sender's counts (``GET
/sandbox/webhooks``) and cutting its delay short (``POST /sandbox/webhooks/flush``), and
moving the server clock (``POST /sandbox/clock/advance {"seconds"}``). They take no fault
and no base latency: a control must answer at once. No authentication: the server only
listens on loopback. docs/sandbox.md documents each route.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import unquote

from ._faults import FaultPlan, parse_fault
from ._ledger import Clock, EffectStatus, Ledger
from ._webhooks import Outbox

__all__ = ["ADMIN_PREFIX", "HEALTH_PATH", "ControlAnswer", "Controlled", "handle_admin", "is_admin"]

ControlAnswer = tuple[int, dict[str, Any]]  # status and JSON body; the acquirer makes the reply


class Controlled(Protocol):
    """What the control routes act on (the acquirer's state)."""

    faults: FaultPlan
    ledger: Ledger
    outbox: Outbox
    clock: Clock


def _error(status: int, type_: str, code: str, **extra: Any) -> ControlAnswer:
    """The acquirer's error shape: ``{"error": {"type", "code", …}}``."""
    return status, {"error": {"type": type_, "code": code, **extra}}


ADMIN_PREFIX = "/sandbox/"
HEALTH_PATH = "/healthz"
MAX_TIMES = 10_000  # one-shot faults queued by one request


def is_admin(path: str) -> bool:
    return path == HEALTH_PATH or path.startswith(ADMIN_PREFIX)


def _body(raw: bytes) -> dict[str, Any] | None:
    """The request's JSON object ({} when empty), or None when it is not one."""
    if not raw.strip():
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def handle_admin(  # noqa: PLR0911 - one return per route
    acquirer: Controlled, method: str, path: str, raw: bytes
) -> ControlAnswer:
    """ControlAnswer one control request: its status and JSON body."""
    if path == HEALTH_PATH:
        return (200, {"ok": True})
    body = _body(raw) if method in ("POST", "PUT", "PATCH") else {}
    if body is None:
        return _error(400, "invalid_request_error", "invalid_json")
    route = path.removeprefix(ADMIN_PREFIX)
    if route == "faults":
        return _faults(acquirer, method, body)
    if route.startswith("effects/") and route.endswith("/settle") and method == "POST":
        effect_id = unquote(route.removeprefix("effects/").removesuffix("/settle"))
        return _settle(acquirer, effect_id, body)
    if route == "webhooks" and method == "GET":
        return (200, _webhooks(acquirer))
    if route == "webhooks/flush" and method == "POST":
        return (200, {"flushed": acquirer.outbox.flush()})
    if route == "clock/advance" and method == "POST":
        seconds = body.get("seconds")
        if (
            not isinstance(seconds, int | float)
            or isinstance(seconds, bool)
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            return _error(400, "invalid_request_error", "parameter_invalid", param="seconds")
        acquirer.clock.advance(float(seconds))
        acquirer.ledger.settle_due()  # what is due now settles (and sends its webhook)
        return (200, {"offset": acquirer.clock.offset})
    known = route in ("faults", "webhooks", "webhooks/flush", "clock/advance")
    if known or route.endswith("/settle"):
        return _error(405, "invalid_request_error", "method_not_allowed")
    return _error(404, "invalid_request_error", "unknown_route")


def fault_summary(acquirer: Controlled) -> dict[str, Any]:
    """The fault plan as it stands: queued one-shot faults, rates, what POSTs got so far."""
    plan = acquirer.faults
    seen = Counter(f.value if f is not None else "none" for f in plan.log())
    return {
        "queued": [f.value for f in plan.queued()],
        "rates": {f.value: rate for f, rate in plan.rates().items()},
        "seen": dict(sorted(seen.items())),
    }


def _faults(
    acquirer: Controlled,
    method: str,
    body: Mapping[str, Any],
) -> ControlAnswer:
    if method == "GET":
        return (200, fault_summary(acquirer))
    if method == "DELETE":
        acquirer.faults.clear()
        return (200, fault_summary(acquirer))
    if method != "POST":
        return _error(405, "invalid_request_error", "method_not_allowed")
    return _inject(acquirer, body)


def _inject(
    acquirer: Controlled,
    body: Mapping[str, Any],
) -> ControlAnswer:
    """``POST /sandbox/faults {"fault": KIND, "times": N}``: queue KIND for the next N POSTs."""
    name = body.get("fault")
    times = body.get("times", 1)
    if not isinstance(name, str):
        return _error(400, "invalid_request_error", "parameter_invalid", param="fault")
    try:
        fault = parse_fault(name)
    except ValueError as exc:
        return _error(400, "invalid_request_error", "unknown_fault", message=str(exc))
    if not isinstance(times, int) or isinstance(times, bool) or not 1 <= times <= MAX_TIMES:
        return _error(400, "invalid_request_error", "parameter_invalid", param="times")
    acquirer.faults.inject(fault, times)
    return (200, fault_summary(acquirer))


def _settle(
    acquirer: Controlled,
    effect_id: str,
    body: Mapping[str, Any],
) -> ControlAnswer:
    outcome = body.get("outcome", EffectStatus.SUCCEEDED.value)
    allowed = (EffectStatus.SUCCEEDED.value, EffectStatus.DECLINED.value)
    if outcome not in allowed:
        return _error(400, "invalid_request_error", "parameter_invalid", param="outcome")
    try:
        effect = acquirer.ledger.settle(effect_id, EffectStatus(outcome))
    except KeyError:
        return _error(404, "invalid_request_error", "resource_missing")
    except ValueError as exc:  # already settled the other way, or voided
        return _error(409, "invalid_request_error", "already_settled", message=str(exc))
    return (200, effect)


def _webhooks(acquirer: Controlled) -> dict[str, Any]:
    outbox = acquirer.outbox
    acquirer.ledger.settle_due()  # a read: due settlements emit their events first
    return {**outbox.stats(), "targets": list(outbox.urls), "delay_seconds": outbox.delay}
