"""Prometheus metrics (extra ``payorch[metrics]``; without it every name here is a no-op).

The public face of :mod:`payorch.observing._metrics`: payorch's own registry (never the
global one), the process-wide switch, the state gauges of a store (a ``Store`` or an
``AsyncStore``: :mod:`payorch.storage._probes` adapts the async one), and the exposition::

    from payorch import metrics

    app.add_route("/metrics", metrics.asgi_app(store=store))  # ASGI: 200 at /metrics
    metrics.watch(store)  # elsewhere: the state gauges (one indexed read per scrape)
    await metrics.refresh()  # an AsyncStore's gauges, read on the loop, then:
    body = prometheus_client.generate_latest(metrics.registry)
"""

from __future__ import annotations

from .observing._metrics import (
    AVAILABLE,
    AsyncGaugeSource,
    GaugeSource,
    MetricsApp,
    StoreGauges,
    enabled,
    exposition,
    refresh,
    registry,
    set_enabled,
)
from .storage._probes import asgi_app, watch

__all__ = [
    "AVAILABLE",
    "AsyncGaugeSource",
    "GaugeSource",
    "MetricsApp",
    "StoreGauges",
    "asgi_app",
    "enabled",
    "exposition",
    "refresh",
    "registry",
    "set_enabled",
    "watch",
]
