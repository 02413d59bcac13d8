"""payorch: one explainable effect per payment operation."""

from .core import State
from .daemon import ReconcilerDaemon
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    IdempotencyError,
    IdempotencyKeyExpired,
    IdempotencyKeyReused,
    InvalidIdempotencyKey,
    InvalidMoney,
    InvalidRequest,
    InvalidTenant,
    InvalidTransition,
    OperationInProgress,
    OperationNotFound,
    PayorchError,
    ProviderError,
    ProviderIdempotencyError,
    RequestValidationFailed,
    StaleVersion,
    StateConflict,
    StorageError,
    UnknownOperationType,
    UnknownProvider,
    WebhookMalformed,
    WebhookRejected,
    WebhookSignatureInvalid,
)
from .executor import Executor, RetryPolicy
from .http import HttpAnswer, http_answer
from .operations import OperationType, Registry, default_registry
from .outcome import Outcome
from .provider import Answer, AnswerKind, Provider, StatusQuery, SubmitRequest, WebhookEvent
from .reconciler import Reconciler, ReconcileReport, ReconcilerPolicy
from .records import ClaimResult, EventRecord, NewOperation, OperationRecord
from .settings import Settings
from .store import Store
from .webhooks import WebhookHandler, WebhookResult, WebhookStatus

__all__ = [
    "Answer",
    "AnswerKind",
    "ClaimResult",
    "ConfigurationError",
    "DatabaseUnavailable",
    "EventRecord",
    "Executor",
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
    "OperationInProgress",
    "OperationNotFound",
    "OperationRecord",
    "OperationType",
    "Outcome",
    "PayorchError",
    "Provider",
    "ProviderError",
    "ProviderIdempotencyError",
    "ReconcileReport",
    "Reconciler",
    "ReconcilerDaemon",
    "ReconcilerPolicy",
    "Registry",
    "RequestValidationFailed",
    "RetryPolicy",
    "Settings",
    "StaleVersion",
    "State",
    "StateConflict",
    "StatusQuery",
    "StorageError",
    "Store",
    "SubmitRequest",
    "UnknownOperationType",
    "UnknownProvider",
    "WebhookEvent",
    "WebhookHandler",
    "WebhookMalformed",
    "WebhookRejected",
    "WebhookResult",
    "WebhookSignatureInvalid",
    "WebhookStatus",
    "default_registry",
    "http_answer",
]
