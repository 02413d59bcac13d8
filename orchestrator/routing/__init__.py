"""Routing across providers: per operation type, an ordered choice of providers by rules,
volume splits and health; a move to the next provider only on proof that the current
attempt did not execute (docs/routing.md).

Public: :class:`Router`, :class:`Rule`, :class:`HealthPolicy`, :class:`Choice`,
:class:`Proof`, :func:`attempt_key`, :func:`touched`, :func:`attempts_of`, and
:func:`load_router` (a routing table from a TOML or JSON file).
"""

from __future__ import annotations

from ._config import load_router, router_from_mapping
from ._health import Health, HealthPolicy
from ._route import (
    Proof,
    attempt_key,
    attempts_of,
    first_route,
    key_at,
    moved,
    next_provider,
    proves_not_sent,
    touched,
)
from ._rules import Choice, Router, Rule

__all__ = [
    "Choice",
    "Health",
    "HealthPolicy",
    "Proof",
    "Router",
    "Rule",
    "attempt_key",
    "attempts_of",
    "first_route",
    "key_at",
    "load_router",
    "moved",
    "next_provider",
    "proves_not_sent",
    "router_from_mapping",
    "touched",
]
