"""Prometheus metrics (extra ``payorch[metrics]``; without it every name here is a no-op).

The public face of :mod:`payorch.observing._metrics`: payorch's own registry (never the
global one), the process-wide switch, the state gauges of a store, and the exposition::

    from payorch import metrics

    body = prometheus_client.generate_latest(metrics.registry)
    metrics.watch(store)  # the state gauges too (one indexed read per scrape)
"""

from __future__ import annotations

from .observing._metrics import (
    AVAILABLE,
    GaugeSource,
    StoreGauges,
    enabled,
    exposition,
    registry,
    set_enabled,
    watch,
)

__all__ = [
    "AVAILABLE",
    "GaugeSource",
    "StoreGauges",
    "enabled",
    "exposition",
    "registry",
    "set_enabled",
    "watch",
]
