"""The scrape-time gauge families beyond the operations' own (:class:`StoreGauges` of
:mod:`payorch.observing._metrics` yields them): the outbox, settlement reconciliation and
PostgreSQL replication, each from the values :meth:`~payorch.Store.read_gauges` read.

Imported only where ``prometheus_client`` is installed (the gauges are collected only then).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CLASSES", "outbox_gauges", "recon_gauges", "replication_gauges"]

# The classes of a settlement row (payorch.recon.RowClass): every one is reported, 0 or not.
CLASSES = (
    "matched",
    "mismatch",
    "settles_unknown",
    "contradiction",
    "duplicate",
    "orphan",
    "other",
)


def outbox_gauges(box: Mapping[str, Any], effects_attention: int) -> Iterator[Any]:
    """The outbox's backlog and dead letters, and payorch.once's escalated effects."""
    messages = GaugeMetricFamily(
        "payorch_outbox_messages", "Outbox messages not delivered, by state", labels=["state"]
    )
    messages.add_metric(["pending"], box["pending"])
    messages.add_metric(["dead"], box["dead"])
    yield messages
    for name, text, value in (
        ("payorch_outbox_due_messages", "Outbox messages due for delivery now", box["due"]),
        (
            "payorch_outbox_oldest_pending_age_seconds",
            "Age of the oldest pending outbox message (0: none)",
            box["oldest_pending_age"],
        ),
        (
            "payorch_effects_needs_attention",
            "Effects (payorch.once) escalated for a human",
            effects_attention,
        ),
    ):
        gauge = GaugeMetricFamily(name, text)
        gauge.add_metric([], value)
        yield gauge


def replication_gauges(status: Mapping[str, Any]) -> Iterator[Any]:
    """The PostgreSQL replication mode (one series per mode, 1 for the current one) and
    the standbys streaming (absent when the role may not see them)."""
    mode = GaugeMetricFamily(
        "payorch_database_replication_mode",
        "1 for the database's replication mode now (sync: commits wait for a streaming "
        "synchronous standby), 0 for the others",
        labels=["mode"],
    )
    for name in status["modes"]:
        mode.add_metric([name], 1.0 if status["mode"] == name else 0.0)
    yield mode
    for name, text, value in (
        (
            "payorch_database_sync_standbys",
            "Synchronous standbys streaming",
            status["sync_standbys"],
        ),
        ("payorch_database_standbys", "Standbys streaming", status["standbys"]),
    ):
        if value is not None:
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], float(value))
            yield gauge


def recon_gauges(recon: Mapping[str, Any]) -> Iterator[Any]:
    """Settlement reports (payorch.recon), per provider as its last import or report counted:
    rows by class (duplicates among them), the operations no report has shown yet, those past
    the settlement lag, and the oldest one's age."""
    rows = CounterMetricFamily(
        "payorch_recon_rows",
        "Settlement report rows judged, by class",
        labels=["provider", "class"],
    )
    duplicates = GaugeMetricFamily(
        "payorch_recon_duplicates",
        "Settlement rows that are a second effect for one namespace (flagged critical)",
        labels=["provider"],
    )
    for row in recon["providers"]:
        counts = row["counts"]
        for klass in CLASSES:
            rows.add_metric([row["provider"], klass], counts.get(klass, 0))
        duplicates.add_metric([row["provider"]], counts.get("duplicate", 0))
    yield rows
    yield duplicates
    for name, text, key in (
        ("payorch_recon_expected_operations", "Succeeded operations no report showed yet",
         "expected"),
        ("payorch_recon_overdue_operations",
         "Expected operations past the settlement lag (flagged)", "overdue"),
        ("payorch_recon_oldest_expected_age_seconds",
         "Age of the oldest expected operation (0: none), as last counted", "oldest_expected_age"),
    ):  # fmt: skip
        gauge = GaugeMetricFamily(name, text, labels=["provider"])
        for row in recon["providers"]:
            gauge.add_metric([row["provider"]], row[key])
        yield gauge
