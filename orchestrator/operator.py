"""What an operator does to one operation, from code (``payorch ops`` runs the same
functions): recheck it at the provider, resolve it with evidence, void an unknown
authorisation at the provider, or acknowledge a terminal operation flagged for attention. A
resolution and an acknowledgement each write one audit event, of type
:data:`RESOLUTION_EVENT` or :data:`ACKNOWLEDGED_EVENT`; a void's first event names its actor
and reason. The public face of :mod:`payorch.reconciling._operator`.
"""

from __future__ import annotations

from .reconciling._operator import (
    ACKNOWLEDGED_EVENT,
    RESOLUTION_EVENT,
    VOID_EVENT,
    RecheckResult,
    acknowledge,
    recheck,
    resolve,
    void,
)

__all__ = [
    "ACKNOWLEDGED_EVENT",
    "RESOLUTION_EVENT",
    "VOID_EVENT",
    "RecheckResult",
    "acknowledge",
    "recheck",
    "resolve",
    "void",
]
