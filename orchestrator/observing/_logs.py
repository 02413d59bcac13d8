"""Structured log lines through the standard :mod:`logging` module.

Loggers: ``payorch.executor``, ``payorch.reconciler``, ``payorch.webhooks``, ``payorch.db``
(every logger payorch uses is listed in ``docs/embedding.md``). Without any logging
configuration WARNING and above reach stderr (Python's last resort): payorch installs no
``NullHandler``, so a misconfiguration is seen.
Every line payorch emits has a stable event name (``record.event``) and its fields as record
attributes (``extra``), and a message that repeats them as ``event key=value …`` for
plain formatters. Fields are identifiers and classifications: operation id, tenant,
operation, provider, state transition (``from_state`` → ``to_state``), attempt, answer
kind, codes. Never an idempotency key (the client's or the downstream one), never a
request or response body, never an error's message (a database error can quote a key).

=============================  =======  ==================================================
event                          level    when
=============================  =======  ==================================================
``execute.refused``            INFO     a 4xx answer: reused key, in progress, invalid …
``execute.failed``             ERROR    a 5xx: storage failure, outcome not recorded …
``attempt.answered``           DEBUG    a provider answered one attempt (classified)
``attempt.retrying``           INFO     certainly not sent: the same key again after a pause
``operation.transition``       INFO     a recorded state change (DEBUG in the reconciler)
``operation.needs_attention``  WARNING  flagged for a human, with ``reason``
``operation.late_answer``      WARNING  an answer arrived after the lease was lost
``reconcile.checked``          DEBUG    one reconciler check and its result
``reconcile.pass``             INFO     one pass that found work (daemon and CLI)
``reconcile.progress``         INFO     every so many checks of a long pass (CLI)
``reconciler.started``         INFO     the daemon's first line
``webhook.handled``            INFO     a verified delivery and what it did
``webhook.rejected``           WARNING  a delivery refused (signature, shape, storage)
``database.replication``       INFO     start-up: the replication mode (``payorch.db``) and
                                        its ``meaning``; WARNING when it puts something
                                        at risk (async, sync_blocked, unknown)
=============================  =======  ==================================================

Each helper checks ``isEnabledFor`` before it builds anything, so a level that is off costs
one call. :func:`configure` sets up the CLI's output (``--log-format json|text``).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..outcome import WebhookResult
    from ..provider import Answer, SubmitRequest
    from ..records import OperationRecord

__all__ = [
    "FORMATS",
    "JsonFormatter",
    "TextFormatter",
    "answered",
    "attention_reason",
    "checked",
    "command_default",
    "configure",
    "emit",
    "escalated",
    "late_answer",
    "no_provider",
    "reconcile_pass",
    "reconcile_progress",
    "reconciler_started",
    "refused",
    "retrying",
    "transition",
    "webhook",
    "webhook_refused",
]

executor_log = logging.getLogger("payorch.executor")
reconciler_log = logging.getLogger("payorch.reconciler")
webhooks_log = logging.getLogger("payorch.webhooks")
# No NullHandler on "payorch": an application that configured no logging at all still
# sees payorch's WARNING and ERROR lines on stderr (Python's ``logging.lastResort``), so a
# misconfiguration (a database never migrated, a standby) is never silent. Nothing that
# happens in normal operation is logged at WARNING; INFO and DEBUG stay quiet until the
# application configures logging (docs/embedding.md, "Logging").

FORMATS = ("text", "json")
DEBUG = logging.DEBUG


def emit(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """One structured line (the fields that are None are left out)."""
    if not logger.isEnabledFor(level):
        return
    present = {k: v for k, v in fields.items() if v is not None}
    message = " ".join([event, *(f"{k}={_text(v)}" for k, v in present.items())])
    logger.log(level, message, extra={"event": event, **present}, stacklevel=2)


def _text(value: Any) -> str:
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    if isinstance(value, Mapping):  # counts by name: a=1,b=2
        return ",".join(f"{k}={_text(v)}" for k, v in value.items()) or "-"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    if not text or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


# -- executor ---------------------------------------------------------------------------------


def refused(call: Mapping[str, Any], exc: Exception) -> None:
    """``execute()`` raised: INFO for the caller's (4xx), WARNING for a provider that could
    not be reached (nothing sent; the same key runs again), ERROR for ours (5xx, unexpected)."""
    from ..errors import PayorchError, ProviderUnavailable

    status = exc.http_status if isinstance(exc, PayorchError) else 500
    level = logging.INFO if status < 500 else logging.ERROR
    if isinstance(exc, ProviderUnavailable):
        level = logging.WARNING
    if not executor_log.isEnabledFor(level):
        return
    emit(
        executor_log,
        level,
        "execute.refused" if status < 500 else "execute.failed",
        tenant_id=_str(call.get("tenant_id")),
        operation=_str(call.get("operation")),
        provider=_str(call.get("provider")) or None,
        operation_id=_str(getattr(exc, "operation_id", None)),
        error=type(exc).__name__,
        http_status=status,
    )


def answered(request: SubmitRequest, attempt: int, answer: Answer) -> None:
    if not executor_log.isEnabledFor(logging.DEBUG):
        return
    emit(
        executor_log,
        logging.DEBUG,
        "attempt.answered",
        operation_id=request.operation_id,
        tenant_id=request.tenant_id,
        operation=request.operation,
        attempt=attempt,
        answer_kind=answer.kind.value,
        possibly_sent=answer.possibly_sent,
        status_code=answer.status_code,
        code=answer.code,
    )


def retrying(request: SubmitRequest, attempt: int, answer: Answer, delay: float) -> None:
    if not executor_log.isEnabledFor(logging.INFO):
        return
    emit(
        executor_log,
        logging.INFO,
        "attempt.retrying",
        operation_id=request.operation_id,
        tenant_id=request.tenant_id,
        operation=request.operation,
        attempt=attempt,
        answer_kind=answer.kind.value,
        code=answer.code,
        retry_in_ms=round(delay * 1000, 1),
    )


def attention_reason(event: str, detail: Mapping[str, Any] | None) -> str:
    """Why a write flagged an operation, from the evidence it recorded."""
    info = detail or {}
    decision = info.get("decision")
    if isinstance(decision, str) and decision.startswith("escalate"):
        return decision  # the reconciler's own words: why it will not act
    for key in ("needs_attention", "conflict", "conflicts_with", "code"):
        value = info.get(key)
        if isinstance(value, str) and value:
            return f"conflicts with {value}" if key == "conflicts_with" else value
    if info.get("duplicate"):
        return "duplicate effects at the provider"
    return event


def transition(
    before: OperationRecord,
    after: OperationRecord,
    event: str,
    detail: Mapping[str, Any] | None = None,
    *,
    logger: logging.Logger = executor_log,
    level: int = logging.INFO,
) -> None:
    """A recorded write: ``operation.transition`` (INFO; the reconciler's are DEBUG, its
    passes say INFO), and a WARNING if it newly flagged the operation for a human."""
    if after.needs_attention and not before.needs_attention:
        escalated(after, attention_reason(event, detail), event, logger=logger)
    if not logger.isEnabledFor(level):
        return
    emit(
        logger,
        level,
        "operation.transition",
        operation_id=after.id,
        tenant_id=after.tenant_id,
        operation=after.operation,
        provider=after.provider,
        from_state=before.state.value,
        to_state=after.state.value,
        event_kind=event,
        attempts=after.attempts,
        checks=after.checks,
        error_code=after.error_code,
    )


def escalated(
    record: OperationRecord, reason: str, event: str, *, logger: logging.Logger = executor_log
) -> None:
    """WARNING ``operation.needs_attention``: a human must look, and why."""
    emit(
        logger,
        logging.WARNING,
        "operation.needs_attention",
        operation_id=record.id,
        tenant_id=record.tenant_id,
        operation=record.operation,
        provider=record.provider,
        state=record.state.value,
        event_kind=event,
        reason=reason,
    )


def late_answer(record: OperationRecord, answer: Answer, conflict: str | None) -> None:
    emit(
        executor_log,
        logging.WARNING,
        "operation.late_answer",
        operation_id=record.id,
        tenant_id=record.tenant_id,
        operation=record.operation,
        state=record.state.value,
        answer_kind=answer.kind.value,
        conflict=conflict,
    )


# -- reconciler ---------------------------------------------------------------------------------


def checked(before: OperationRecord, result: str) -> None:
    if not reconciler_log.isEnabledFor(logging.DEBUG):
        return
    emit(
        reconciler_log,
        logging.DEBUG,
        "reconcile.checked",
        operation_id=before.id,
        tenant_id=before.tenant_id,
        operation=before.operation,
        provider=before.provider,
        from_state=before.state.value,
        result=result,
    )


def reconcile_pass(
    picked: int, outcomes: Mapping[str, int], released: int, *, total: int | None = None
) -> None:
    """INFO ``reconcile.pass``: what one pass (or one batch of a longer run) settled."""
    emit(
        reconciler_log,
        logging.INFO,
        "reconcile.pass",
        picked=picked,
        outcomes=dict(sorted(outcomes.items())),
        released=released or None,
        total_picked=total,
    )


def no_provider(record: Any) -> None:
    """WARNING ``operation.no_provider``: a due operation whose adapter this process lacks;
    it waits, checked by nobody, until a process with that adapter runs."""
    emit(
        reconciler_log,
        logging.WARNING,
        "operation.no_provider",
        operation_id=record.id,
        tenant_id=record.tenant_id,
        provider=record.provider,
        fix="run the tools with the app's adapters: PAYORCH_PROVIDERS=module:attribute",
    )


def reconcile_progress(done: int, picked: int) -> None:
    emit(reconciler_log, logging.INFO, "reconcile.progress", checked=done, picked=picked)


def reconciler_started(owner: str, interval_seconds: float) -> None:
    emit(
        reconciler_log,
        logging.INFO,
        "reconciler.started",
        owner=owner,
        interval_seconds=interval_seconds,
        schedule=f"a pass every {interval_seconds:g}s, Ctrl-C or SIGTERM to stop",
    )


# -- webhooks -----------------------------------------------------------------------------------


def webhook(tenant_id: str, provider: str, result: WebhookResult) -> None:
    if not webhooks_log.isEnabledFor(logging.INFO):
        return
    emit(
        webhooks_log,
        logging.INFO,
        "webhook.handled",
        tenant_id=tenant_id,
        provider=provider,
        status=result.status.value,
        event_id=result.event_id,
        operation_id=result.operation_id,
        state=result.state.value if result.state is not None else None,
    )


def webhook_refused(tenant_id: str, provider: str, exc: Exception) -> None:
    from ..errors import PayorchError, WebhookRejected

    status = exc.http_status if isinstance(exc, PayorchError) else 500
    level = logging.WARNING if isinstance(exc, WebhookRejected) or status < 500 else logging.ERROR
    emit(
        webhooks_log,
        level,
        "webhook.rejected" if status < 500 else "webhook.failed",
        tenant_id=tenant_id,
        provider=provider,
        error=type(exc).__name__,
        http_status=status,
    )


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


# -- output -------------------------------------------------------------------------------------

# What every LogRecord has; anything else on a record came in through ``extra``.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "event"}


def _time(record: logging.LogRecord) -> str:
    stamp = datetime.fromtimestamp(record.created, tz=UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event and the fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _time(record),
            "level": record.levelname,
            "logger": record.name,
        }
        event = getattr(record, "event", None)
        if isinstance(event, str):
            line["event"] = event
        else:  # a line from elsewhere (a library, payorch's plain messages)
            line["message"] = record.getMessage()
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                line.setdefault(key, value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``<UTC time> <LEVEL> <logger> <message>``: payorch's messages carry their fields."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _time(record)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]  # TextIO, set per emit
    """Writes to the ``sys.stderr`` of the moment: a test runner swaps it per command."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


_chosen: list[bool] = [False]  # whether the last configure() was given a level


def configure(fmt: str = "text", *, level: int | None = None) -> logging.Handler:
    """Send log lines to stderr in ``fmt`` ("text" or "json"), replacing what an earlier
    call installed. ``level`` is payorch's (None: WARNING, unless a command asks for more,
    :func:`command_default`); libraries stay at WARNING (httpx's INFO lines would print
    request URLs, and a status query's URL holds a downstream key).

    For the CLI and the daemon; an embedding application configures logging its own way.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.set_name("payorch-cli")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "payorch-cli"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("payorch").setLevel(level if level is not None else logging.NOTSET)
    _chosen[0] = level is not None
    return handler


def command_default(level: int) -> None:
    """The level a command wants for payorch's loggers, unless ``--log-level`` chose one."""
    if not _chosen[0]:
        logging.getLogger("payorch").setLevel(level)
