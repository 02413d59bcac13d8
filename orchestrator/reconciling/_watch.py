"""The reconciler daemon's scheduled look for provider effects no operation explains."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ..errors import PayorchError
from ..observing import _logs as logs
from ..operations import Registry
from ..provider import EffectLister
from ..storage._store import Store
from ._findings import ScanReport, Verdict
from ._unexplained import installation_scope, log, scan

__all__ = ["UnexplainedWatch"]


@dataclass(kw_only=True)
class UnexplainedWatch:
    """The reconciler daemon's scheduled look (``PAYORCH_UNEXPLAINED_EVERY_SECONDS``): each
    run lists the trailing ``window`` of every provider given, adopting when ``adopt``,
    under ``key_scope`` (None: the environment's ``PAYORCH_KEY_SCOPE``, read once here, so a
    bad one refuses start-up), judging only the effects of ``tenant_ids`` when given."""

    store: Store
    providers: Sequence[EffectLister]
    every: timedelta
    window: timedelta
    adopt: bool = False
    actor: str = "reconciler"
    reason: str = "adopted by the reconciler daemon's scheduled look (PAYORCH_UNEXPLAINED_ADOPT)"
    registry: Registry | None = None
    key_scope: str | None = None
    # The tenants whose effects it judges and adopts (a sharded reconciler's tenant_ids; the
    # daemon passes its reconciler's); None: every tenant.
    tenant_ids: Collection[str] | None = None

    def __post_init__(self) -> None:
        self.key_scope = installation_scope(self.key_scope)
        if self.tenant_ids is not None:
            self.tenant_ids = frozenset(self.tenant_ids)

    def run(self) -> list[ScanReport]:
        """One look at each provider; a provider that fails is logged and skipped."""
        until = datetime.now(UTC)
        reports = []
        for provider in self.providers:
            try:
                report = scan(
                    self.store,
                    provider,
                    since=until - self.window,
                    until=until,
                    adopt_found=self.adopt,
                    actor=self.actor,
                    reason=self.reason,
                    registry=self.registry,
                    key_scope=self.key_scope,
                    tenant_ids=self.tenant_ids,
                )
            except PayorchError as exc:  # the provider or the database is away: next run
                logs.emit(
                    log,
                    logging.WARNING,
                    "unexplained.skipped",
                    provider=provider.name,
                    error=exc.message,
                )
                continue
            level = logging.WARNING if _left_unexplained(report) else logging.INFO
            logs.emit(
                log, level, "unexplained.scanned", provider=report.provider, **report.counts()
            )
            reports.append(report)
        return reports


def _left_unexplained(report: ScanReport) -> bool:
    return any(f.verdict is not Verdict.EXPLAINED for f in report.findings)
