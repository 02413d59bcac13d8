"""Observing: structured logs, OpenTelemetry spans and Prometheus metrics.

Internal (every module here is ``_private``): the public faces are ``payorch.metrics`` and
``payorch.tracing``. Imports the base modules at the top of ``payorch`` only; it never reads
the database itself (the store hands its numbers to the metrics' gauges).
"""

__all__: list[str] = []
