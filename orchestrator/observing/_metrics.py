"""Prometheus metrics: one registry that owns every metric payorch exports.

Counters and histograms are updated where the work happens (executor, reconciler, webhook
handler, daemon); the state gauges are computed when scraped, by :class:`StoreGauges`, from
cheap indexed queries. Label values are bounded: operation types and providers this process
configured, states, answer kinds, error names; never a key, a tenant or an operation id.

Without ``prometheus_client`` (the ``payorch[metrics]`` extra) everything here is a no-op:
``registry`` is ``None``, the decorators return the function they were given, and the
helpers hand out objects whose methods do nothing.

An embedding service exposes :data:`registry` itself: :func:`asgi_app` (which refreshes the
gauges of an async source first, on the event loop), or
``prometheus_client.generate_latest(payorch.metrics.registry)``, and calls :func:`watch` with
its store for the state gauges. ``payorch.metrics.watch`` also takes an ``AsyncStore``
(``storage/_probes.py`` adapts it: this layer cannot read a store).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, Protocol, TypeVar, cast

try:
    import prometheus_client
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError:  # without the extra every metric is a no-op
    prometheus_client = None  # type: ignore[assignment]  # the module or nothing
    Collector = object  # type: ignore[assignment,misc]  # only a base class below

from ..core import State
from ..errors import ConfigurationError, PayorchError, WebhookRejected
from ..provider import AnswerKind
from ._bounded import OneAtATime

__all__ = [
    "AVAILABLE",
    "AsyncGaugeSource",
    "GaugeSource",
    "MetricsApp",
    "Recorder",
    "StoreGauges",
    "asgi_app",
    "checked",
    "counts_executions",
    "counts_webhooks",
    "delivery",
    "enabled",
    "escalated",
    "exposition",
    "for_execution",
    "for_provider",
    "pass_finished",
    "refresh",
    "registry",
    "set_enabled",
    "watch",
    "webhook_counted",
]

AVAILABLE = prometheus_client is not None
UNKNOWN = "unknown"  # the label value for a name this process does not know (bounded)
RETURNED = ("fresh", "replayed", "existing")  # refused: counted by counts_executions
F = TypeVar("F", bound=Callable[..., Any])

_enabled = AVAILABLE


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    """Switch recording on or off at run time (the scrape still answers); for benchmarks."""
    global _enabled  # noqa: PLW0603 - one process-wide switch
    _enabled = on and AVAILABLE


def error_name(exc: BaseException) -> str:
    """A bounded label for an error: the last part of its stable problem type."""
    if isinstance(exc, PayorchError):
        return exc.problem_type.rsplit(":", 1)[-1].replace("-", "_")
    return "internal_error"


if prometheus_client is not None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry: CollectorRegistry | None = CollectorRegistry()
    _FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
    _SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def _counter(name: str, doc: str, *labels: str) -> Counter:
        return Counter(f"payorch_{name}", doc, labels, registry=registry)

    def _histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
        return Histogram(f"payorch_{name}", doc, labels, buckets=buckets, registry=registry)

    _OP = ("operation", "provider")
    EXECUTIONS = _counter(
        "executions",
        "execute() calls by result: fresh, replayed, existing (unknown as it stands), refused",
        *_OP,
        "result",
    )
    REFUSALS = _counter(
        "execution_refusals",
        "execute() calls that raised, by the error's short name",
        *_OP,
        "reason",
    )
    OUTCOMES = _counter("execution_outcomes", "States fresh executions ended in", *_OP, "state")
    EXECUTE_SECONDS = _histogram(
        "execute_duration_seconds",
        "execute() latency of calls that returned",
        _SLOW,
        *_OP,
        "result",
    )
    CLAIM_SECONDS = _histogram("claim_duration_seconds", "Latency of the claim", _FAST)
    ANSWERS = _counter(
        "provider_answers",
        "Provider answers by call (submit, status) and kind",
        "provider",
        "call",
        "kind",
    )
    PROVIDER_SECONDS = _histogram(
        "provider_call_duration_seconds", "Latency of one provider call", _SLOW, "provider", "call"
    )
    RETRIES = _counter(
        "inline_retries",
        "Attempts retried inline (the previous one certainly not sent)",
        "provider",
    )
    CHECKS = _counter("reconciler_checks", "Reconciler checks by result", "result")
    ESCALATIONS = _counter(
        "escalations", "Operations newly flagged needs_attention, by reason", "reason"
    )
    WEBHOOKS = _counter(
        "webhooks",
        "Webhook deliveries by status (rejected: signature or body)",
        "provider",
        "status",
    )
    PASSES = _counter(
        "reconciler_passes", "Daemon passes: ok, skipped (database away), failed", "result"
    )
    DELIVERIES = _counter(
        "outbox_deliveries",
        "Outbox delivery attempts by destination and result: delivered, failed, dead",
        "destination",
        "result",
    )
    DELIVERY_SECONDS = _histogram(
        "outbox_delivery_duration_seconds", "Latency of one sink delivery", _SLOW, "destination"
    )
    LAST_PASS = Gauge(
        "payorch_reconciler_last_pass_timestamp_seconds",
        "Unix time the daemon's last successful pass finished",
        registry=registry,
    )
else:
    registry = None


class _Nothing:
    """Stands in for every bound metric when recording is off: each method does nothing."""

    def claimed(self, seconds: float) -> None:
        pass

    def finished(self, result: str, started: float, state: State | None = None) -> None:
        pass

    def answered(self, call: str, kind: AnswerKind, seconds: float) -> None:
        pass

    def retried(self) -> None:
        pass


_NOTHING = _Nothing()
Recorder = _Nothing  # what for_execution() and for_provider() hand out


class ExecutionMetrics(_Nothing):
    """The children of one (operation, provider), bound once: no label look-ups per call."""

    __slots__ = ("_outcomes", "_results")

    def __init__(self, operation: str, provider: str) -> None:
        self._results = {
            r: (
                EXECUTIONS.labels(operation, provider, r),
                EXECUTE_SECONDS.labels(operation, provider, r),
            )
            for r in RETURNED
        }
        self._outcomes = {s: OUTCOMES.labels(operation, provider, s.value) for s in State}

    def claimed(self, seconds: float) -> None:
        CLAIM_SECONDS.observe(seconds)

    def finished(self, result: str, started: float, state: State | None = None) -> None:
        count, latency = self._results[result]
        count.inc()
        latency.observe(time.perf_counter() - started)
        if state is not None:
            self._outcomes[state].inc()


class ProviderMetrics(_Nothing):
    __slots__ = ("_answers", "_retries", "_seconds")

    def __init__(self, provider: str) -> None:
        calls = ("submit", "status", "void")
        self._answers = {
            (c, k): ANSWERS.labels(provider, c, k.value) for c in calls for k in AnswerKind
        }
        self._seconds = {c: PROVIDER_SECONDS.labels(provider, c) for c in calls}
        self._retries = RETRIES.labels(provider)

    def answered(self, call: str, kind: AnswerKind, seconds: float) -> None:
        self._answers[call, kind].inc()
        self._seconds[call].observe(seconds)

    def retried(self) -> None:
        self._retries.inc()


_executions: dict[tuple[str, str], ExecutionMetrics] = {}
_providers: dict[str, ProviderMetrics] = {}
_checks: dict[str, Any] = {}
_escalations: dict[str, Any] = {}


def for_execution(operation: str, provider: str) -> _Nothing:
    """The bound metrics of one configured (operation type, provider)."""
    if not _enabled:
        return _NOTHING
    found = _executions.get((operation, provider))
    if found is None:
        found = _executions.setdefault((operation, provider), ExecutionMetrics(operation, provider))
    return found


def for_provider(provider: str) -> _Nothing:
    if not _enabled:
        return _NOTHING
    found = _providers.get(provider)
    if found is None:
        found = _providers.setdefault(provider, ProviderMetrics(provider))
    return found


def _child(cache: dict[str, Any], metric: Any, value: str) -> Any:
    found = cache.get(value)
    if found is None:
        found = cache.setdefault(value, metric.labels(value))
    return found


def checked(result: str) -> None:
    """One reconciler check ended with ``result`` (a bounded word, as in its report)."""
    if _enabled:
        _child(_checks, CHECKS, result).inc()


def escalated(reason: str) -> None:
    """An operation was newly flagged ``needs_attention`` (the write committed)."""
    if _enabled:
        _child(_escalations, ESCALATIONS, reason).inc()


def delivery(destination: str, result: str, seconds: float) -> None:
    """One outbox delivery attempt to ``destination`` ended with ``result``."""
    if _enabled:
        DELIVERIES.labels(destination, result).inc()
        DELIVERY_SECONDS.labels(destination).observe(seconds)


def pass_finished(result: str) -> None:
    if _enabled:
        PASSES.labels(result).inc()
        if result == "ok":
            LAST_PASS.set_to_current_time()


def counts_executions(fn: F) -> F:
    """Counts what ``Executor.execute`` raises (the refusals; what returns counts itself)."""
    if not AVAILABLE:
        return fn

    @functools.wraps(fn)
    def execute(self: Any, /, **kwargs: Any) -> Any:
        try:
            return fn(self, **kwargs)
        except Exception as exc:
            if _enabled:
                operation, provider = _labels(self, kwargs.get("operation"), kwargs.get("provider"))
                EXECUTIONS.labels(operation, provider, "refused").inc()
                REFUSALS.labels(operation, provider, error_name(exc)).inc()
            raise

    return cast(F, execute)


def _labels(executor: Any, operation: Any, provider: Any) -> tuple[str, str]:
    """Bounded labels for a refused call: names this executor knows, else ``unknown``."""
    op_type = executor.registry.types.get(operation) if isinstance(operation, str) else None
    if not provider and op_type is not None:
        provider = op_type.provider
    known = isinstance(provider, str) and provider in executor.providers
    return (operation if op_type is not None else UNKNOWN, provider if known else UNKNOWN)


def counts_webhooks(fn: F) -> F:
    """Counts ``WebhookHandler.handle`` by the status it returns, or ``rejected``/``error``."""
    if not AVAILABLE:
        return fn

    @functools.wraps(fn)
    def handle(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(self, *args, **kwargs)
        except Exception as exc:
            if _enabled:
                name = args[1] if len(args) > 1 else kwargs.get("provider")
                known = name if isinstance(name, str) and name in self.providers else UNKNOWN
                status = "rejected" if isinstance(exc, WebhookRejected) else "error"
                WEBHOOKS.labels(known, status).inc()
            raise
        if _enabled:
            name = args[1] if len(args) > 1 else kwargs["provider"]
            WEBHOOKS.labels(name, str(result.status)).inc()
        return result

    return cast(F, handle)


def webhook_counted(provider: str | None, status: str) -> None:
    """One item of a delivery taken (by its status) or refused (``rejected``)."""
    if AVAILABLE and _enabled:
        WEBHOOKS.labels(provider or UNKNOWN, status).inc()


# -- gauges computed at scrape time ---------------------------------------------------


class GaugeSource(Protocol):
    """What the state gauges read (a :class:`~payorch.Store`): its numbers by the database
    clock, in one read (:meth:`~payorch.Store.read_gauges`)."""

    def read_gauges(self) -> dict[str, Any]: ...


class AsyncGaugeSource(Protocol):
    """The same read, awaited on an event loop (what ``payorch.metrics.watch`` makes of an
    ``AsyncStore``). A collector is called synchronously, so these values are read by
    :meth:`StoreGauges.refresh` before the exposition (:func:`asgi_app` does it)."""

    async def read_gauges(self) -> dict[str, Any]: ...


class StoreGauges(Collector):
    """Reads the operations table when scraped: active states, due backlog, attention, the
    oldest unknown, and ``payorch_database_up`` (0, never an error, when the read fails or
    takes longer than ``timeout``); on PostgreSQL the replication mode and standbys too.

    A sync source is read by :meth:`collect` (on a worker thread, one at a time); an async
    one by :meth:`refresh`, and :meth:`collect` reports what the last refresh read.
    """

    def __init__(self, store: GaugeSource | AsyncGaugeSource, *, timeout: float = 5.0) -> None:
        self.store = store
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(store.read_gauges)
        sync = None if self.is_async else cast(GaugeSource, store).read_gauges
        self.read = None if sync is None else OneAtATime(sync, timeout=timeout)
        self._last: dict[str, Any] | None = None
        self._reading: asyncio.Task[dict[str, Any]] | None = None

    async def refresh(self) -> None:
        """Read an async source now, at most ``timeout``; overlapping scrapes share the read
        in flight (a slow database never has more than one), a refresh after a time-out
        starts a fresh one (a sync source: nothing to do, :meth:`collect` reads it)."""
        if not self.is_async:
            return
        loop = asyncio.get_running_loop()
        task = self._reading
        if task is None or task.done() or task.get_loop() is not loop:
            read = cast(AsyncGaugeSource, self.store).read_gauges()
            # The one deadline: the task ends only once its timed-out read is cancelled.
            task = loop.create_task(asyncio.wait_for(read, self.timeout))
            task.add_done_callback(_retrieved)  # a failure is a 0, never a loop warning
            self._reading = task
        try:
            # No second timer (it would fire first and leave the read running); shield: a
            # scrape cancelled by its client does not cancel the read another one awaits.
            self._last = await asyncio.shield(task)
        except Exception:  # noqa: BLE001 - time-out or database error: payorch_database_up 0
            self._last = None

    def describe(self) -> Iterator[Any]:
        return iter(())  # no query at registration time

    def collect(self) -> Iterator[Any]:
        values = self._last if self.read is None else self.read()
        up = GaugeMetricFamily("payorch_database_up", "1 if the state query succeeded")
        up.add_metric([], 0.0 if values is None else 1.0)
        yield up
        if values is None:
            return
        ops = GaugeMetricFamily(
            "payorch_operations", "Non-terminal operations by state", labels=["state"]
        )
        for state, count in values["by_state"].items():
            ops.add_metric([state], count)
        yield ops
        for name, text, key in (
            ("payorch_due_operations", "Operations due for a reconciler check now", "due"),
            ("payorch_needs_attention_operations", "Operations flagged for a human", "attention"),
            (
                "payorch_oldest_unknown_age_seconds",
                "Age of the oldest outcome_unknown operation (0: none)",
                "oldest_unknown_age",
            ),
        ):
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], values[key])
            yield gauge
        # Here, not at the top: it needs prometheus_client, which collect() implies.
        from ._families import outbox_gauges, recon_gauges, replication_gauges

        if "outbox" in values:
            yield from outbox_gauges(values["outbox"], values.get("effects_attention", 0))
        if "recon" in values:
            yield from recon_gauges(values["recon"])
        if "replication" in values:
            yield from replication_gauges(values["replication"])


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


_watched: list[StoreGauges] = []


def watch(store: GaugeSource | AsyncGaugeSource, *, timeout: float = 5.0) -> StoreGauges | None:
    """Export the state gauges of ``store`` in :data:`registry` (replaces an earlier one).

    A sync :class:`~payorch.Store`, or an :class:`AsyncGaugeSource` (``payorch.metrics.watch``
    turns an ``AsyncStore`` into one), whose values :func:`refresh` reads.
    """
    if not callable(getattr(store, "read_gauges", None)):
        raise ConfigurationError(
            f"metrics.watch() needs a Store or an AsyncStore, not {type(store).__name__}: "
            "pass the store your service executes with (fix the call)"
        )
    if registry is None:
        return None
    for old in _watched:
        registry.unregister(old)
    _watched.clear()
    gauges = StoreGauges(store, timeout=timeout)
    registry.register(gauges)
    _watched.append(gauges)
    return gauges


async def refresh() -> None:
    """Read the state gauges of a watched async source (each read at most its time-out).

    Await it before rendering :data:`registry` yourself; :func:`asgi_app` does it per scrape.
    """
    await asyncio.gather(*(gauges.refresh() for gauges in list(_watched)))


def exposition() -> tuple[bytes, str] | None:
    """The registry in the text format and its content type; ``None`` without the extra."""
    if registry is None:
        return None
    return prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST


Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class MetricsApp:
    """An ASGI app that answers ``GET``/``HEAD`` with :data:`registry` at whatever path it
    is routed to (it never looks at the path, so nothing redirects): route it at the exact
    path, e.g. ``app.add_route("/metrics", metrics.asgi_app(store=store))``.

    Each scrape awaits :func:`refresh` (an async store is read on the loop), then renders; a
    sync store is read while rendering, so that runs on a worker thread, off the loop.
    Without ``prometheus_client`` it answers 404 saying what is missing, like the daemon.
    """

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # served alone (uvicorn): nothing to start
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        headers: list[tuple[bytes, bytes]] = [(b"content-type", b"text/plain; charset=utf-8")]
        if scope["method"] not in ("GET", "HEAD"):
            status, body = 405, b"method not allowed: use GET or HEAD\n"
            headers.append((b"allow", b"GET, HEAD"))
        elif registry is None:
            status, body = 404, b"metrics need the payorch[metrics] extra\n"
        else:
            status, body, content_type = 200, *await _render(scope)
            headers = [(b"content-type", content_type.encode())]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )


async def _render(scope: Message) -> tuple[bytes, str]:
    """The exposition in the format the scraper accepts (text or OpenMetrics)."""
    from prometheus_client.exposition import choose_encoder

    accept = b",".join(v for k, v in scope.get("headers", ()) if k == b"accept").decode("latin-1")
    encoder, content_type = choose_encoder(accept)
    await refresh()
    assert registry is not None  # checked by the caller
    if all(gauges.is_async for gauges in _watched):
        return encoder(registry), content_type  # no I/O left: the values are read
    return await asyncio.to_thread(encoder, registry), content_type


def asgi_app(
    *, store: GaugeSource | AsyncGaugeSource | None = None, timeout: float = 5.0
) -> MetricsApp:
    """The ASGI app serving :data:`registry`; with ``store``, :func:`watch` it first."""
    if store is not None:
        watch(store, timeout=timeout)
    return MetricsApp()
