"""A routed operation's route as its row keeps it (``payorch_operations.route``; no I/O).

::

    {"rule": "eu-cards", "providers": ["acquirer_a", "acquirer_b"], "skipped": [],
     "ref": "<the namespace ref>",
     "attempts": [{"provider": "acquirer_a", "downstream_key": "payorch:…:submit",
                   "proof": "not_sent", "code": "connect_error"},
                  {"provider": "acquirer_b", "downstream_key": "payorch:…:submit"}]}

``providers`` is the decision made before the first call, replayed with the operation;
``ref`` the namespace's ref (``payorch.core.namespace_ref``), from which each provider's
downstream key is derived (:func:`attempt_key`) by anyone, with no key scope at hand;
``attempts`` every provider it was sent to, in order, the last one current (the row's
``provider`` and ``downstream_key``); each earlier one carries the proof that let it move on.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from typing import Any

from ..core import attempt_ref, downstream_key
from ..provider import Answer, AnswerKind
from ._rules import Choice

__all__ = [
    "Proof",
    "attempt_key",
    "attempts_of",
    "first_route",
    "key_at",
    "moved",
    "next_provider",
    "proves_not_sent",
    "touched",
]


class Proof(enum.StrEnum):
    """What proves an attempt did not execute, so its operation may move on."""

    NOT_SENT = "not_sent"  # no byte of it reached the provider
    LISTED_DECLINE = "listed_decline"  # a final decline whose code the router lists
    VOIDED = "voided"  # the provider confirmed a void under its key
    NOT_FOUND = "not_found_past_window"  # nothing under its key, past the window, no webhook


# A provider's "your key is being processed right now" (409): this request did nothing, but
# another under the key is executing there and may move money.
_KEY_IN_USE_STATUS = 409


def proves_not_sent(answer: Answer) -> bool:
    """Whether ``answer`` proves that nothing under its key executed: certainly not sent
    (refused connection, pool time-out, 429, credentials refused, the adapter refusing to
    build it), and not the provider saying the key is in use (a 409 in flight)."""
    return answer.kind is AnswerKind.NOT_SENT and answer.status_code != _KEY_IN_USE_STATUS


def attempt_key(ref: str, provider: str) -> str:
    """The downstream key of a routed operation's attempt at ``provider``, from its
    namespace's ``ref``: stable across crashes and database failovers, its own per provider."""
    return downstream_key(attempt_ref(ref, provider))


def first_route(choice: Choice, ref: str) -> dict[str, Any]:
    """The route a claim stores: the decision, and its first attempt."""
    first = choice.providers[0]
    return {
        "rule": choice.rule,
        "providers": list(choice.providers),
        "skipped": list(choice.skipped),
        "ref": ref,
        "attempts": [{"provider": first, "downstream_key": attempt_key(ref, first)}],
    }


def key_at(route: Mapping[str, Any], provider: str) -> str | None:
    """The downstream key of ``route``'s attempt at ``provider``; None without its ref."""
    ref = route.get("ref")
    return attempt_key(ref, provider) if isinstance(ref, str) and ref else None


def attempts_of(route: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The route's attempts, oldest first (empty for an unrouted operation or a bad route)."""
    found = (route or {}).get("attempts")
    if not isinstance(found, list):
        return []
    return [dict(a) for a in found if isinstance(a, Mapping) and isinstance(a.get("provider"), str)]


def touched(route: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """Every (provider, downstream key) the operation was sent to, each once, oldest first."""
    seen: list[tuple[str, str]] = []
    for attempt in attempts_of(route):
        pair = (attempt["provider"], str(attempt.get("downstream_key") or ""))
        if pair not in seen:
            seen.append(pair)
    return seen


def next_provider(
    route: Mapping[str, Any] | None, visited: Collection[str], usable: Collection[str]
) -> str | None:
    """The first of the route's providers not ``visited`` yet (in this call) that is
    ``usable`` (configured here); None when the route is spent."""
    for provider in (route or {}).get("providers") or ():
        if isinstance(provider, str) and provider not in visited and provider in usable:
            return provider
    return None


def moved(
    route: Mapping[str, Any],
    *,
    proof: Proof,
    code: str | None,
    to: str,
    key: str,
    reference: str | None = None,
) -> dict[str, Any]:
    """The route after its current attempt was proven not to have executed (``proof``,
    the answer's ``code``, the provider's ``reference`` of it, a decline's say) and the
    operation moved to provider ``to`` under ``key``."""
    attempts = attempts_of(route)
    if attempts:
        attempts[-1]["proof"] = proof.value
        if code:
            attempts[-1]["code"] = code
        if reference:
            attempts[-1]["reference"] = reference
    attempts.append({"provider": to, "downstream_key": key})
    return {**dict(route), "attempts": attempts}
