"""Settlement reconciliation's metrics (payorch.recon): rows judged, by class.

``payorch_recon_rows_total{class}`` counts in the process that imports (a daemon or an app
that imports reports); the scrape-time gauges (duplicates open, the oldest expected
operation) are the store's, read by :class:`~payorch.observing._metrics.StoreGauges`.
"""

from __future__ import annotations

from typing import Any

from . import _metrics as metrics

__all__ = ["CLASSES", "row_judged"]

CLASSES = (
    "matched",
    "mismatch",
    "settles_unknown",
    "contradiction",
    "duplicate",
    "orphan",
    "other",
)
_ROWS: Any = None
if metrics.registry is not None:
    from prometheus_client import Counter

    _ROWS = Counter(
        "payorch_recon_rows",
        "Settlement report rows judged, by class",
        ["class"],
        registry=metrics.registry,
    )


def row_judged(klass: str) -> None:
    if _ROWS is not None and metrics.enabled():
        _ROWS.labels(klass if klass in CLASSES else metrics.UNKNOWN).inc()
