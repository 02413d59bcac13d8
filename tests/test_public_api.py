"""The public surface is pinned: changing it is a deliberate act."""

from __future__ import annotations

import payorch
from payorch import errors

EXPECTED = [
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
    "DatabaseReadOnly",
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


def test_all_is_pinned_and_sorted() -> None:
    assert payorch.__all__ == EXPECTED
    assert sorted(payorch.__all__) == payorch.__all__
    for name in payorch.__all__:
        assert hasattr(payorch, name)


def test_every_error_derives_from_the_base_and_has_a_status() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.PayorchError)
        assert 400 <= cls.http_status <= 599


def test_every_error_has_its_own_stable_problem_type() -> None:
    types = {}
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert "problem_type" in vars(cls), f"{name} must set its own problem_type"
        assert cls.problem_type.startswith("urn:payorch:problem:")
        types[cls.problem_type] = name
    assert len(types) == len(errors.__all__)  # no two errors share a type


def test_errors_survive_pickling() -> None:
    import pickle

    exc = errors.OperationInProgress("busy", operation_id="op-1", retry_after=3.0)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is errors.OperationInProgress
    assert (again.operation_id, again.retry_after, again.message) == ("op-1", 3.0, "busy")
