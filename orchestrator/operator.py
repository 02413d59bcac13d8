"""What an operator does to a stuck operation, from code (the CLI's ``payorch ops`` runs the
same functions): recheck it at the provider, resolve it with evidence, or acknowledge an
unexplained effect; each writes an audit event. The public face of
:mod:`payorch.reconciling._operator`.
"""

from __future__ import annotations

from .reconciling._operator import RecheckResult, acknowledge, recheck, resolve

__all__ = ["RecheckResult", "acknowledge", "recheck", "resolve"]
