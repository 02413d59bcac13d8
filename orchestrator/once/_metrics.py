"""``payorch_effects_total{namespace, result}``: what each call of an effect answered.

On payorch's own registry (``payorch.metrics.registry``); a no-op without
``prometheus_client`` or while metrics are switched off. ``namespace`` is a name given in
code (a bounded label, like an operation type); never a key, a tenant or an id.

Results: ``fresh`` (ran, succeeded), ``replayed``, ``failed`` (ran, recorded final),
``failed_replayed``, ``released`` (retry_on, or a rerun_safe run that may re-run),
``escalated`` (now outcome_unknown, for an operator), ``unknown`` (answered as escalated
before), ``in_progress``, ``key_reused``, ``storage_error``.
"""

from __future__ import annotations

from typing import Any

from ..observing import _metrics as base

__all__ = ["RESULTS", "counted"]

RESULTS = (
    "fresh",
    "replayed",
    "failed",
    "failed_replayed",
    "released",
    "escalated",
    "unknown",
    "in_progress",
    "key_reused",
    "storage_error",
)

_EFFECTS: Any = None
if base.AVAILABLE and base.registry is not None:
    from prometheus_client import Counter

    _EFFECTS = Counter(
        "payorch_effects",
        "payorch.once calls by namespace and what they answered",
        ("namespace", "result"),
        registry=base.registry,
    )

_children: dict[tuple[str, str], Any] = {}


def counted(namespace: str, result: str) -> None:
    if _EFFECTS is None or not base.enabled():
        return
    child = _children.get((namespace, result))
    if child is None:  # labels() takes a lock and builds a key: once per pair
        child = _children.setdefault((namespace, result), _EFFECTS.labels(namespace, result))
    child.inc()
