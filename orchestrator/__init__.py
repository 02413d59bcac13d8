"""payorch: one explainable effect per payment operation.

The names below are imported on first use (PEP 562), so that ``payorch --help`` and a
service that needs only ``payorch.errors`` do not pay for SQLAlchemy, httpx and pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import State
    from .errors import (
        CommitUncertain,
        ConfigurationError,
        CorruptRecord,
        DatabaseReadOnly,
        DatabaseUnavailable,
        IdempotencyError,
        IdempotencyKeyExpired,
        IdempotencyKeyReused,
        InvalidIdempotencyKey,
        InvalidMoney,
        InvalidRequest,
        InvalidTenant,
        InvalidTransition,
        NoRoute,
        OperationInProgress,
        OperationNotFound,
        OutcomeNotRecorded,
        PayorchError,
        ProviderError,
        ProviderIdempotencyError,
        RequestBodyNotJson,
        RequestValidationFailed,
        SchemaNotReady,
        StaleVersion,
        StateConflict,
        StorageError,
        SyncStandbyUnavailable,
        UnencodableRequest,
        UnknownOperationType,
        UnknownProvider,
        WebhookMalformed,
        WebhookRejected,
        WebhookSignatureInvalid,
        WebhookUnstorable,
    )
    from .execution._async import AsyncExecutor
    from .execution._executor import Executor, RetryPolicy
    from .http import (
        HttpAnswer,
        http_answer,
        parse_idempotency_key,
        parse_json_body,
        webhook_answer,
    )
    from .operations import OperationType, Registry, default_registry
    from .outcome import Outcome, WebhookResult, WebhookStatus
    from .provider import (
        Answer,
        AnswerKind,
        AsyncProvider,
        Provider,
        StatusQuery,
        SubmitRequest,
        WebhookEvent,
    )
    from .reconciling._async import AsyncReconciler, AsyncWebhookHandler
    from .reconciling._crossings import CrossCheck, DuplicatePolicy
    from .reconciling._daemon import ReconcilerDaemon
    from .reconciling._fallback_watch import FallbackWatch
    from .reconciling._reconciler import Reconciler, ReconcileReport, ReconcilerPolicy
    from .reconciling._webhooks import WebhookHandler
    from .records import ClaimResult, EventRecord, NewOperation, OperationRecord
    from .settings import Settings
    from .storage._async_store import AsyncStore
    from .storage._store import Store

_EXPORTS: dict[str, str] = {
    "Answer": "provider",
    "AnswerKind": "provider",
    "AsyncExecutor": "execution._async",
    "AsyncProvider": "provider",
    "AsyncReconciler": "reconciling._async",
    "AsyncStore": "storage._async_store",
    "AsyncWebhookHandler": "reconciling._async",
    "ClaimResult": "records",
    "CommitUncertain": "errors",
    "ConfigurationError": "errors",
    "CorruptRecord": "errors",
    "CrossCheck": "reconciling._crossings",
    "DatabaseReadOnly": "errors",
    "DatabaseUnavailable": "errors",
    "DuplicatePolicy": "reconciling._crossings",
    "EventRecord": "records",
    "Executor": "execution._executor",
    "FallbackWatch": "reconciling._fallback_watch",
    "HttpAnswer": "http",
    "IdempotencyError": "errors",
    "IdempotencyKeyExpired": "errors",
    "IdempotencyKeyReused": "errors",
    "InvalidIdempotencyKey": "errors",
    "InvalidMoney": "errors",
    "InvalidRequest": "errors",
    "InvalidTenant": "errors",
    "InvalidTransition": "errors",
    "NewOperation": "records",
    "NoRoute": "errors",
    "OperationInProgress": "errors",
    "OperationNotFound": "errors",
    "OperationRecord": "records",
    "OperationType": "operations",
    "Outcome": "outcome",
    "OutcomeNotRecorded": "errors",
    "PayorchError": "errors",
    "Provider": "provider",
    "ProviderError": "errors",
    "ProviderIdempotencyError": "errors",
    "ReconcileReport": "reconciling._reconciler",
    "Reconciler": "reconciling._reconciler",
    "ReconcilerDaemon": "reconciling._daemon",
    "ReconcilerPolicy": "reconciling._reconciler",
    "Registry": "operations",
    "RequestBodyNotJson": "errors",
    "RequestValidationFailed": "errors",
    "RetryPolicy": "execution._executor",
    "SchemaNotReady": "errors",
    "Settings": "settings",
    "StaleVersion": "errors",
    "State": "core",
    "StateConflict": "errors",
    "StatusQuery": "provider",
    "StorageError": "errors",
    "Store": "storage._store",
    "SyncStandbyUnavailable": "errors",
    "SubmitRequest": "provider",
    "UnencodableRequest": "errors",
    "UnknownOperationType": "errors",
    "UnknownProvider": "errors",
    "WebhookEvent": "provider",
    "WebhookHandler": "reconciling._webhooks",
    "WebhookMalformed": "errors",
    "WebhookRejected": "errors",
    "WebhookResult": "outcome",
    "WebhookSignatureInvalid": "errors",
    "WebhookStatus": "outcome",
    "WebhookUnstorable": "errors",
    "default_registry": "operations",
    "http_answer": "http",
    "parse_idempotency_key": "http",
    "parse_json_body": "http",
    "webhook_answer": "http",
}

__all__ = [
    "Answer",
    "AnswerKind",
    "AsyncExecutor",
    "AsyncProvider",
    "AsyncReconciler",
    "AsyncStore",
    "AsyncWebhookHandler",
    "ClaimResult",
    "CommitUncertain",
    "ConfigurationError",
    "CorruptRecord",
    "CrossCheck",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "DuplicatePolicy",
    "EventRecord",
    "Executor",
    "FallbackWatch",
    "HttpAnswer",
    "IdempotencyError",
    "IdempotencyKeyExpired",
    "IdempotencyKeyReused",
    "InvalidIdempotencyKey",
    "InvalidMoney",
    "InvalidRequest",
    "InvalidTenant",
    "InvalidTransition",
    "NewOperation",
    "NoRoute",
    "OperationInProgress",
    "OperationNotFound",
    "OperationRecord",
    "OperationType",
    "Outcome",
    "OutcomeNotRecorded",
    "PayorchError",
    "Provider",
    "ProviderError",
    "ProviderIdempotencyError",
    "ReconcileReport",
    "Reconciler",
    "ReconcilerDaemon",
    "ReconcilerPolicy",
    "Registry",
    "RequestBodyNotJson",
    "RequestValidationFailed",
    "RetryPolicy",
    "SchemaNotReady",
    "Settings",
    "StaleVersion",
    "State",
    "StateConflict",
    "StatusQuery",
    "StorageError",
    "Store",
    "SubmitRequest",
    "SyncStandbyUnavailable",
    "UnencodableRequest",
    "UnknownOperationType",
    "UnknownProvider",
    "WebhookEvent",
    "WebhookHandler",
    "WebhookMalformed",
    "WebhookRejected",
    "WebhookResult",
    "WebhookSignatureInvalid",
    "WebhookStatus",
    "WebhookUnstorable",
    "default_registry",
    "http_answer",
    "parse_idempotency_key",
    "parse_json_body",
    "webhook_answer",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'payorch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
