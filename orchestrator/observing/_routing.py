"""The routing counters (payorch.routing), per provider: attempts, fallbacks, providers
skipped as unhealthy, and effects found at two providers for one namespace.

On the registry of :mod:`payorch.observing._metrics`; nothing is recorded while it is off.
Provider names come from the configuration, so their labels are bounded.
"""

from __future__ import annotations

from . import _metrics

__all__ = ["attempted", "cross_provider_duplicate", "fell_back", "skipped_unhealthy"]

if _metrics.AVAILABLE:
    from prometheus_client import Counter

    ATTEMPTS = Counter(
        "payorch_route_attempts",
        "Provider attempts of routed operations (inline retries at one provider count once)",
        ["provider"],
        registry=_metrics.registry,
    )
    FALLBACKS = Counter(
        "payorch_route_fallbacks",
        "Routed operations moved to their next provider, by the proof that let them",
        ["from_provider", "to_provider", "proof"],
        registry=_metrics.registry,
    )
    SKIPPED = Counter(
        "payorch_route_skipped_unhealthy",
        "New operations that passed over a provider its recent calls marked unhealthy",
        ["provider"],
        registry=_metrics.registry,
    )
    DUPLICATES = Counter(
        "payorch_route_cross_provider_duplicates",
        "Namespaces found with an effect at two providers, by the provider of the later one",
        ["provider"],
        registry=_metrics.registry,
    )


def attempted(provider: str) -> None:
    if _metrics.enabled():
        ATTEMPTS.labels(provider).inc()


def fell_back(from_provider: str, to_provider: str, proof: str) -> None:
    if _metrics.enabled():
        FALLBACKS.labels(from_provider, to_provider, proof).inc()


def skipped_unhealthy(provider: str) -> None:
    if _metrics.enabled():
        SKIPPED.labels(provider).inc()


def cross_provider_duplicate(provider: str) -> None:
    if _metrics.enabled():
        DUPLICATES.labels(provider).inc()
