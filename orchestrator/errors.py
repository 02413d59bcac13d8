"""The one exception hierarchy of payorch.

Every error carries ``http_status``: the status an embedding web app should answer with
(the mapping of ``../docs/semantics.md``). Lower-level errors (SQLAlchemy, psycopg, httpx)
are mapped once, where they enter, with ``raise ... from exc``.

::

    PayorchError
    ├── InvalidRequest                      400  bad input; nothing was written
    │   ├── InvalidIdempotencyKey           400
    │   ├── InvalidTenant                   400
    │   ├── UnknownOperationType            400
    │   ├── RequestValidationFailed         422  the request model refused the payload
    │   └── InvalidMoney                    400  float / non-integer amounts, bad currency
    ├── IdempotencyError
    │   ├── IdempotencyKeyReused            422  same namespace, other fingerprint
    │   ├── OperationInProgress             409  + retry_after
    │   └── IdempotencyKeyExpired           410  namespace past retention (tombstone)
    ├── OperationNotFound                   404
    ├── StateConflict                       409
    │   ├── StaleVersion                    409  compare-and-set lost (fencing)
    │   └── InvalidTransition               409  the state machine forbids it
    ├── ConfigurationError                  500  refused at start-up
    │   └── UnknownProvider                 500
    ├── ProviderError                       502
    │   └── ProviderIdempotencyError        502  provider says our key was reused differently
    ├── WebhookRejected                     400
    │   ├── WebhookSignatureInvalid         400  missing/bad signature or stale timestamp
    │   └── WebhookMalformed                400  not JSON / not the provider's shape
    └── StorageError                        503
        └── DatabaseUnavailable             503
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigurationError",
    "DatabaseUnavailable",
    "IdempotencyError",
    "IdempotencyKeyExpired",
    "IdempotencyKeyReused",
    "InvalidIdempotencyKey",
    "InvalidMoney",
    "InvalidRequest",
    "InvalidTenant",
    "InvalidTransition",
    "OperationInProgress",
    "OperationNotFound",
    "PayorchError",
    "ProviderError",
    "ProviderIdempotencyError",
    "RequestValidationFailed",
    "StaleVersion",
    "StateConflict",
    "StorageError",
    "UnknownOperationType",
    "UnknownProvider",
    "WebhookMalformed",
    "WebhookRejected",
    "WebhookSignatureInvalid",
]


class PayorchError(Exception):
    """Base of every error payorch raises on purpose."""

    http_status: int = 500

    def __init__(self, message: str, *, operation_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.operation_id = operation_id

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep errors picklable across process pools: keyword-only args are not in self.args.
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))


def _rebuild(cls: type[PayorchError], message: str, state: dict[str, Any]) -> PayorchError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class InvalidRequest(PayorchError):
    http_status = 400


class InvalidIdempotencyKey(InvalidRequest):
    pass


class InvalidTenant(InvalidRequest):
    pass


class UnknownOperationType(InvalidRequest):
    pass


class InvalidMoney(InvalidRequest):
    pass


class RequestValidationFailed(InvalidRequest):
    http_status = 422

    def __init__(self, message: str, *, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class IdempotencyError(PayorchError):
    http_status = 409


class IdempotencyKeyReused(IdempotencyError):
    """The key was first used with other effect fields; nothing was executed."""

    http_status = 422


class OperationInProgress(IdempotencyError):
    """Another request holds this namespace; ask again after ``retry_after`` seconds."""

    http_status = 409

    def __init__(self, message: str, *, operation_id: str, retry_after: float) -> None:
        super().__init__(message, operation_id=operation_id)
        self.retry_after = retry_after


class IdempotencyKeyExpired(IdempotencyError):
    """The namespace is past its retention window; only a tombstone remains."""

    http_status = 410


class OperationNotFound(PayorchError):
    http_status = 404


class StateConflict(PayorchError):
    http_status = 409


class StaleVersion(StateConflict):
    """A compare-and-set on ``version`` found another writer got there first."""


class InvalidTransition(StateConflict):
    pass


class ConfigurationError(PayorchError):
    http_status = 500


class UnknownProvider(ConfigurationError):
    pass


class ProviderError(PayorchError):
    http_status = 502


class ProviderIdempotencyError(ProviderError):
    pass


class WebhookRejected(PayorchError):
    http_status = 400


class WebhookSignatureInvalid(WebhookRejected):
    pass


class WebhookMalformed(WebhookRejected):
    pass


class StorageError(PayorchError):
    http_status = 503


class DatabaseUnavailable(StorageError):
    pass
