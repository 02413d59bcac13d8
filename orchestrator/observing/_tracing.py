"""OpenTelemetry spans for payorch, through the OpenTelemetry *API* only.

Install ``payorch[tracing]`` (``opentelemetry-api``) and configure an SDK (the application's
choice: exporter, sampler, resource). payorch then emits:

===========================  ==============================================================
span                         attributes (``payorch.*``)
===========================  ==============================================================
``payorch.execute``          operation, provider, tenant_id, operation_id, state, replayed,
                             error (the refusal's class name)
``payorch.claim``            provider, created, replayed
``payorch.provider.submit``  provider, attempt, downstream_key_hash (SHA-256, 16 hex
                             digits: the key itself never leaves the store), answer_kind,
                             possibly_sent, status_code
``payorch.record``           operation_id, from_state, to_state, event
``payorch.reconcile.check``  operation_id, tenant_id, provider, from_state, result
``payorch.webhook``          provider, tenant_id, status, event_type, operation_id
===========================  ==============================================================

and the adapters send the W3C ``traceparent`` of the current span to the provider.

Without the package, or with it but no SDK configured, every helper here is a no-op that
costs a dictionary look-up: OpenTelemetry is looked for in ``sys.modules`` (an application
that configured an SDK has imported it), never imported on the hot path.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from . import _logs as logs

if TYPE_CHECKING:
    from ..core import State
    from ..outcome import Outcome, WebhookDelivery, WebhookResult
    from ..provider import Answer, SubmitRequest
    from ..records import OperationRecord

__all__ = [
    "NOOP_SPAN",
    "SpanLike",
    "answered",
    "attempt",
    "claim",
    "downstream_key_hash",
    "enabled",
    "inject",
    "instrumented_check",
    "instrumented_delivery",
    "instrumented_execute",
    "instrumented_webhook",
    "record",
    "set_attributes",
    "use_tracer_provider",
]

P = ParamSpec("P")
R = TypeVar("R")
SpanLike = Any  # an opentelemetry Span, or NOOP_SPAN


class _NoopSpan:
    """What the helpers yield when nothing records: accepts and drops everything."""

    def __enter__(self) -> _NoopSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def is_recording(self) -> bool:
        return False


NOOP_SPAN = _NoopSpan()

# The tracer provider last seen, and payorch's tracer from it (one slot: providers rarely
# change, tests swap them).
_cache: list[tuple[object, Any]] = []
_chosen: list[Any] = []  # a provider given to use_tracer_provider(), instead of the global one


def use_tracer_provider(provider: Any | None) -> None:
    """Trace with ``provider`` (an OpenTelemetry ``TracerProvider``) instead of the global
    one; None: the global one again. For an application that keeps its providers local,
    and for benchmarks that compare tracing on and off in one process."""
    _chosen[:] = [] if provider is None else [provider]


def _tracer() -> Any | None:
    """payorch's tracer when an SDK (any real TracerProvider) is configured, else None."""
    if _chosen:
        provider = _chosen[0]
    else:
        trace = sys.modules.get("opentelemetry.trace")
        if trace is None:  # not installed, blocked, or nobody configured tracing
            return None
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None  # the API's default: spans would record nothing
    if _cache and _cache[0][0] is provider:
        return _cache[0][1]
    tracer = provider.get_tracer("payorch", _version())
    _cache[:] = [(provider, tracer)]
    return tracer


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("payorch")
    except PackageNotFoundError:
        return None


def enabled() -> bool:
    """Whether payorch's spans go anywhere (an OpenTelemetry SDK is configured)."""
    return _tracer() is not None


def _span(name: str, attributes: dict[str, Any]) -> AbstractContextManager[SpanLike]:
    tracer = _tracer()
    if tracer is None:
        return NOOP_SPAN
    span: AbstractContextManager[SpanLike] = tracer.start_as_current_span(
        name, attributes=attributes
    )
    return span


def set_attributes(span: SpanLike, **attributes: Any) -> None:
    """Set the attributes that are not None (OpenTelemetry refuses None values)."""
    if span is NOOP_SPAN:
        return
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(f"payorch.{key}", value)


def downstream_key_hash(key: str) -> str:
    """What a span says of a downstream key: enough to match two spans, not to replay it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


# -- execute ----------------------------------------------------------------------------------


def instrumented_execute(fn: Callable[P, Outcome]) -> Callable[P, Outcome]:
    """``Executor.execute`` under a ``payorch.execute`` span, and a log line when it refuses.

    The refusal (a :class:`~payorch.errors.PayorchError`) is an attribute, not a span error,
    when it is the caller's (4xx): a reused key is the contract working, not a failure.
    """

    @functools.wraps(fn)
    def execute(*args: P.args, **kwargs: P.kwargs) -> Outcome:
        tracer = _tracer()
        if tracer is None:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                logs.refused(kwargs, exc)
                raise
        attributes = {
            f"payorch.{name}": kwargs[field]
            for name, field in (("operation", "operation"), ("tenant_id", "tenant_id"))
            if isinstance(kwargs.get(field), str)
        }
        if kwargs.get("provider"):
            attributes["payorch.provider"] = kwargs["provider"]
        with tracer.start_as_current_span(
            "payorch.execute",
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                outcome = fn(*args, **kwargs)
            except Exception as exc:
                _refused(span, exc)
                logs.refused(kwargs, exc)
                raise
            set_attributes(
                span,
                operation_id=outcome.operation_id,
                state=outcome.state.value,
                replayed=outcome.replayed,
                needs_attention=outcome.needs_attention,
            )
            return outcome

    return execute


def instrumented_delivery(
    fn: Callable[..., WebhookDelivery],
) -> Callable[..., WebhookDelivery]:
    """``WebhookHandler.handle_delivery(tenant_id, provider, headers, body)`` under a
    ``payorch.webhook`` span: a delivery of one event reads as ``handle``'s does; a batch
    says how many items it carried and how many were refused."""

    def describe(span: SpanLike, delivery: WebhookDelivery) -> None:
        set_attributes(
            span,
            items=len(delivery.results) + len(delivery.rejected),
            refused=len(delivery.rejected),
        )
        if len(delivery.results) == 1:
            _describe_result(span, delivery.results[0])
        if delivery.rejected:
            _refused(span, delivery.rejected[0][1])

    return _webhook_span(fn, describe)


def _webhook_span(
    fn: Callable[..., R], describe: Callable[[SpanLike, R], None]
) -> Callable[..., R]:
    """``fn(self, tenant_id, provider, headers, body)`` under a ``payorch.webhook`` span,
    ``describe`` setting what its result says."""

    @functools.wraps(fn)
    def handle(
        self: Any, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> R:
        tracer = _tracer()
        if tracer is None:
            return fn(self, tenant_id, provider, headers, body)
        attributes = {"payorch.tenant_id": tenant_id, "payorch.provider": provider}
        with tracer.start_as_current_span(
            "payorch.webhook",
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                result = fn(self, tenant_id, provider, headers, body)
            except Exception as exc:
                _refused(span, exc)
                raise
            describe(span, result)
        return result

    return handle


def _describe_result(span: SpanLike, result: WebhookResult) -> None:
    set_attributes(
        span,
        status=result.status.value,
        event_id=result.event_id,
        operation_id=result.operation_id,
        state=result.state.value if result.state is not None else None,
    )


def _refused(span: SpanLike, exc: Exception) -> None:
    from opentelemetry.trace import Status, StatusCode

    from ..errors import PayorchError

    set_attributes(span, error=type(exc).__name__)
    operation_id = getattr(exc, "operation_id", None)
    if isinstance(operation_id, str):
        set_attributes(span, operation_id=operation_id)
    if not isinstance(exc, PayorchError) or exc.http_status >= 500:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


@contextmanager
def _claim(tracer: Any, provider: str) -> Iterator[SpanLike]:
    from opentelemetry import trace

    trace.get_current_span().set_attribute("payorch.provider", provider)  # execute's span
    with tracer.start_as_current_span("payorch.claim") as span:
        span.set_attribute("payorch.provider", provider)
        yield span


def claim(provider: str) -> AbstractContextManager[SpanLike]:
    """The ``payorch.claim`` span; also names the provider on the enclosing execute span.

    Set ``created`` / ``replayed`` on the yielded span with :func:`set_attributes`.
    """
    tracer = _tracer()
    return NOOP_SPAN if tracer is None else _claim(tracer, provider)


# -- provider attempts and records ---------------------------------------------------------------


def attempt(provider: str, request: SubmitRequest, number: int) -> AbstractContextManager[SpanLike]:
    """One ``payorch.provider.submit``; finish it with :func:`answered`."""
    if _tracer() is None:
        return NOOP_SPAN
    return _span(
        "payorch.provider.submit",
        {
            "payorch.provider": provider,
            "payorch.operation_id": request.operation_id,
            "payorch.attempt": number,
            "payorch.downstream_key_hash": downstream_key_hash(request.downstream_key),
        },
    )


def answered(span: SpanLike, answer: Answer) -> None:
    """The classified answer of one attempt, on its span."""
    if span is NOOP_SPAN:
        return
    set_attributes(
        span,
        answer_kind=answer.kind.value,
        possibly_sent=answer.possibly_sent,
        status_code=answer.status_code,
        answer_code=answer.code,
    )


def record(
    before: OperationRecord, to_state: State, event: str
) -> AbstractContextManager[SpanLike]:
    """``payorch.record``: one fenced write of an attempt or an outcome."""
    if _tracer() is None:
        return NOOP_SPAN
    return _span(
        "payorch.record",
        {
            "payorch.operation_id": before.id,
            "payorch.from_state": before.state.value,
            "payorch.to_state": to_state.value,
            "payorch.event": event,
        },
    )


# -- reconciler and webhooks -------------------------------------------------------------------


def instrumented_check(fn: Callable[[Any, OperationRecord, Any], str]) -> Callable[..., str]:
    """``Reconciler.check`` under a ``payorch.reconcile.check`` span, with its log line."""

    @functools.wraps(fn)
    def check(self: Any, before: OperationRecord, now: Any) -> str:
        tracer = _tracer()
        if tracer is None:
            result = fn(self, before, now)
            logs.checked(before, result)
            return result
        attributes = {
            "payorch.operation_id": before.id,
            "payorch.tenant_id": before.tenant_id,
            "payorch.operation": before.operation,
            "payorch.provider": before.provider,
            "payorch.from_state": before.state.value,
        }
        with tracer.start_as_current_span("payorch.reconcile.check", attributes=attributes) as span:
            result = fn(self, before, now)
            span.set_attribute("payorch.result", result)
        logs.checked(before, result)
        return result

    return check


def instrumented_webhook(fn: Callable[..., WebhookResult]) -> Callable[..., WebhookResult]:
    """``WebhookHandler.handle(tenant_id, provider, headers, body)`` under a
    ``payorch.webhook`` span, with its log line (a rejected signature is a WARNING)."""

    @functools.wraps(fn)
    def logged(
        self: Any, tenant_id: str, provider: str, headers: Mapping[str, str], body: bytes
    ) -> WebhookResult:
        try:
            result = fn(self, tenant_id, provider, headers, body)
        except Exception as exc:
            logs.webhook_refused(tenant_id, provider, exc)
            raise
        logs.webhook(tenant_id, provider, result)
        return result

    return _webhook_span(logged, _describe_result)


# -- propagation --------------------------------------------------------------------------------


def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's W3C ``traceparent`` (and any other configured propagation
    headers) to an outgoing request's ``headers``; returns them."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        return headers
    from opentelemetry import propagate

    propagate.inject(headers)
    return headers
