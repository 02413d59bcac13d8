"""OpenTelemetry tracing (extra ``payorch[tracing]``: the API only; the SDK and its exporter
are the application's choice).

The public face of :mod:`payorch.observing._tracing`: payorch records into the global tracer
provider unless :func:`use_tracer_provider` names another; :func:`enabled` says whether
spans are recorded at all. An adapter of your own calls :func:`inject` on its outgoing
headers, as payorch's adapters do, so the provider call carries the ``traceparent``.
"""

from __future__ import annotations

from .observing._tracing import enabled, inject, use_tracer_provider

__all__ = ["enabled", "inject", "use_tracer_provider"]
