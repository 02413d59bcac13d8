"""The one exception hierarchy of payorch.

Every error carries ``http_status``: the status an embedding web app should answer with
(the mapping of ``../docs/semantics.md``), and ``problem_type``: a stable URN that tells
clients apart what a status alone cannot (422 for a reused key vs. a refused payload).
Lower-level errors (SQLAlchemy, psycopg, httpx) are mapped once, where they enter, with
``raise ... from exc``.

Every 503 (the ``StorageError`` branch) carries ``retry_after`` and means "retry the same
idempotency key": a plain ``StorageError`` failed before anything could commit; an
``OutcomeNotRecorded`` failed once the claim may have committed, so the operation may exist
and may have reached the provider. No error ever invites a new key.

::

    PayorchError
    ├── InvalidRequest                      400  bad input; nothing was written
    │   ├── InvalidIdempotencyKey           400
    │   ├── InvalidTenant                   400
    │   ├── UnknownOperationType            400
    │   ├── RequestValidationFailed         422  the request model refused the payload
    │   ├── InvalidMoney                    400  float / non-integer amounts, bad currency
    │   ├── UnencodableRequest              400  no canonical JSON form (surrogate, NaN, set…)
    │   ├── RequestBodyNotJson              400  an HTTP request body that is not JSON
    │   ├── UnknownProvider                 400  the caller named a provider not configured
    │   ├── ListingUnsupported              400  that provider's adapter cannot list effects
    │   ├── SettlementReportInvalid         400  a settlement file that cannot be read (names
    │   │                                        its file, row, column); nothing imported
    │   ├── SettlementAccountMismatch       400  a settlement file of another merchant account
    │   ├── NoRoute                         422  no routing rule matches the request (names
    │   │                                        the operation type); nothing stored
    │   └── InvalidMessage                  400  an outbox or consumer message that cannot
    │                                            be stored (no id, not JSON, too long)
    ├── IdempotencyError
    │   ├── IdempotencyKeyReused            422  same namespace, other fingerprint
    │   ├── OperationInProgress             409  + retry_after
    │   └── IdempotencyKeyExpired           410  namespace past retention (tombstone)
    ├── OperationNotFound                   404
    │   └── MessageNotFound                 404  no outbox message with that id
    ├── EffectFailed                        422  a recorded final failure of an effect
    ├── EffectOutcomeUnknown                202  an effect may have happened: escalated,
    │                                            never run again; same key later
    ├── StateConflict                       409
    │   ├── StaleVersion                    409  compare-and-set lost (fencing)
    │   └── InvalidTransition               409  the state machine forbids it
    ├── ConfigurationError                  500  refused at start-up (or a type's default
    │   │                                        provider missing from the executor)
    │   ├── DatabaseReadOnly                503  a standby or a read-only session; also a
    │   │                                        StorageError: nothing committed, same key
    │   └── SchemaNotReady                  503  payorch's tables missing or older
    │                                            than this install; also a StorageError
    ├── ProviderError                       502
    │   ├── ProviderIdempotencyError        502  provider says our key was reused differently
    │   ├── ProviderUnavailable             503  + retry_after; nothing was sent: same key
    │   └── ProviderListingFailed           502  a listing of effects could not be read
    ├── DeliveryFailed                      502  a sink did not take an outbox message (the
    │                                            relay tries again later, or dead-letters)
    ├── WebhookRejected                     400
    │   ├── WebhookSignatureInvalid         400  missing/bad signature or stale timestamp
    │   └── WebhookMalformed                400  not JSON / not the provider's shape
    │       └── WebhookUnstorable           400  id/type/reference too long for its column
    └── StorageError                        503  + retry_after; nothing committed: same key
        ├── DatabaseUnavailable             503
        │   └── SyncStandbyUnavailable      503  strict mode, no synchronous standby: nothing
        │                                        claimed
        ├── CorruptRecord                   503  a stored row cannot be read; quarantined
        └── OutcomeNotRecorded              503  may have happened: same key, later
            └── CommitUncertain             503  a COMMIT was sent, its answer lost
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

__all__ = [
    "CommitUncertain",
    "ConfigurationError",
    "CorruptRecord",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "DeliveryFailed",
    "EffectFailed",
    "EffectOutcomeUnknown",
    "IdempotencyError",
    "IdempotencyKeyExpired",
    "IdempotencyKeyReused",
    "InvalidIdempotencyKey",
    "InvalidMessage",
    "InvalidMoney",
    "InvalidRequest",
    "InvalidTenant",
    "InvalidTransition",
    "ListingUnsupported",
    "MessageNotFound",
    "NoRoute",
    "OperationInProgress",
    "OperationNotFound",
    "OutcomeNotRecorded",
    "PayorchError",
    "ProviderError",
    "ProviderIdempotencyError",
    "ProviderListingFailed",
    "ProviderUnavailable",
    "RequestBodyNotJson",
    "RequestValidationFailed",
    "SchemaNotReady",
    "SettlementAccountMismatch",
    "SettlementReportInvalid",
    "StaleVersion",
    "StateConflict",
    "StorageError",
    "SyncStandbyUnavailable",
    "UnencodableRequest",
    "UnknownOperationType",
    "UnknownProvider",
    "WebhookMalformed",
    "WebhookRejected",
    "WebhookSignatureInvalid",
    "WebhookUnstorable",
]


class PayorchError(Exception):
    """Base of every error payorch raises on purpose."""

    http_status: int = 500
    # Stable and machine-readable (RFC 9457 ``type``); never derived from the class name, so
    # a rename cannot change what clients match on. Every subclass sets its own.
    problem_type: ClassVar[str] = "urn:payorch:problem:error"

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
    problem_type = "urn:payorch:problem:invalid-request"


class InvalidIdempotencyKey(InvalidRequest):
    problem_type = "urn:payorch:problem:invalid-idempotency-key"


class InvalidTenant(InvalidRequest):
    problem_type = "urn:payorch:problem:invalid-tenant"


class UnknownOperationType(InvalidRequest):
    problem_type = "urn:payorch:problem:unknown-operation-type"


class InvalidMoney(InvalidRequest):
    problem_type = "urn:payorch:problem:invalid-money"


class RequestValidationFailed(InvalidRequest):
    http_status = 422
    problem_type = "urn:payorch:problem:request-validation-failed"

    def __init__(self, message: str, *, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class IdempotencyError(PayorchError):
    http_status = 409
    problem_type = "urn:payorch:problem:idempotency-error"


class IdempotencyKeyReused(IdempotencyError):
    """The key was first used with other effect fields; nothing was executed."""

    http_status = 422
    problem_type = "urn:payorch:problem:idempotency-key-reused"


class OperationInProgress(IdempotencyError):
    """Another request holds this namespace; ask again after ``retry_after`` seconds."""

    http_status = 409
    problem_type = "urn:payorch:problem:operation-in-progress"

    def __init__(self, message: str, *, operation_id: str, retry_after: float) -> None:
        super().__init__(message, operation_id=operation_id)
        self.retry_after = retry_after


class IdempotencyKeyExpired(IdempotencyError):
    """The namespace is past its retention window; only a tombstone remains."""

    http_status = 410
    problem_type = "urn:payorch:problem:idempotency-key-expired"


class OperationNotFound(PayorchError):
    http_status = 404
    problem_type = "urn:payorch:problem:operation-not-found"


class StateConflict(PayorchError):
    http_status = 409
    problem_type = "urn:payorch:problem:state-conflict"


class StaleVersion(StateConflict):
    """A compare-and-set on ``version`` found another writer got there first."""

    problem_type = "urn:payorch:problem:stale-version"


class InvalidTransition(StateConflict):
    problem_type = "urn:payorch:problem:invalid-transition"


class ConfigurationError(PayorchError):
    http_status = 500
    problem_type = "urn:payorch:problem:configuration-error"


class UnknownProvider(InvalidRequest):
    """The caller named a provider this executor (or handler) does not have: bad input.

    A provider missing from the configuration itself (an operation type's default) is a
    :class:`ConfigurationError` instead.
    """

    problem_type = "urn:payorch:problem:unknown-provider"


class ProviderError(PayorchError):
    http_status = 502
    problem_type = "urn:payorch:problem:provider-error"


class ProviderIdempotencyError(ProviderError):
    problem_type = "urn:payorch:problem:provider-idempotency-error"


class ProviderUnavailable(ProviderError):
    """Every attempt was certainly not sent (connect errors, 429, the provider down): no
    money moved, and nothing is stored as this key's outcome. Retry **the same key** after
    ``retry_after`` seconds: it runs again, with the same downstream key. ``code`` is the
    provider's reason (e.g. ``rate_limited``); ``operation_id`` the operation kept for it.
    """

    http_status = 503
    problem_type = "urn:payorch:problem:provider-unavailable"
    retry_after: float = 5.0

    def __init__(
        self,
        message: str,
        *,
        operation_id: str | None = None,
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        if retry_after is not None:
            self.retry_after = retry_after
        self.code = code


class WebhookRejected(PayorchError):
    http_status = 400
    problem_type = "urn:payorch:problem:webhook-rejected"


class WebhookSignatureInvalid(WebhookRejected):
    problem_type = "urn:payorch:problem:webhook-signature-invalid"


class WebhookMalformed(WebhookRejected):
    problem_type = "urn:payorch:problem:webhook-malformed"


class StorageError(PayorchError):
    """The database failed before anything could commit: retry the same key after
    ``retry_after`` seconds (the same key, so a retry can never become a second operation)."""

    http_status = 503
    problem_type = "urn:payorch:problem:storage-unavailable"
    retry_after: float = 1.0

    def __init__(
        self, message: str, *, operation_id: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        if retry_after is not None:
            self.retry_after = retry_after


class DatabaseUnavailable(StorageError):
    problem_type = "urn:payorch:problem:database-unavailable"


class DatabaseReadOnly(ConfigurationError, StorageError):
    """The database payorch reached refuses writes: a standby (in recovery) or a read-only
    session (``default_transaction_read_only``, SQLSTATE 25006). A configuration error: the
    URL must reach the primary (list every host with ``target_session_attrs=read-write``).

    Also a :class:`StorageError` (503): the server refused the write, so nothing committed,
    and a client that meets it mid-operation retries the same key once payorch is pointed
    at the primary. Never retried inline: a standby does not become a primary by waiting.
    """

    http_status = 503
    problem_type = "urn:payorch:problem:database-read-only"
    retry_after: float = 5.0


class SchemaNotReady(ConfigurationError, StorageError):
    """payorch's tables are not what this install needs: missing (``payorch db upgrade``
    never ran against this database), at an older revision, or unreadable by the
    application's role (grant SELECT on ``payorch_alembic_version``). Raised by
    ``Store.check_schema()`` at start-up, and by a statement that meets a table or column
    missing (an older schema, or one a newer migration changed). A newer revision is not
    refused at start-up: it is logged (a rolling deploy migrates first).

    The message names what was found and what to run; a configuration error (a deployment
    step was skipped), and a :class:`StorageError` (503): nothing was written, so a client
    that meets it retries the same key once the schema is upgraded. Never retried inline:
    a schema does not appear by waiting.
    """

    http_status = 503
    problem_type = "urn:payorch:problem:schema-not-ready"
    retry_after: float = 5.0


class SyncStandbyUnavailable(DatabaseUnavailable):
    """Claims require a synchronous standby (``PAYORCH_REQUIRE_SYNC_STANDBY``) and none is
    streaming: nothing was claimed, nothing sent. Retry the same key later."""

    problem_type = "urn:payorch:problem:sync-standby-unavailable"
    retry_after: float = 5.0


class OutcomeNotRecorded(StorageError):
    """The database failed once the claim may have committed: under this key an operation
    may exist and may have reached the provider, and its outcome is not (knowably) stored.

    Retry **the same key** later: the retry returns the operation as it stands (in progress,
    unknown, or settled by the reconciler), never a second effect. ``operation_id`` is set
    when known.
    """

    problem_type = "urn:payorch:problem:outcome-not-recorded"


class CommitUncertain(OutcomeNotRecorded):
    """A COMMIT was sent and its answer lost (connection cut, server gone): it may have
    committed. Raised by the database layer for any write; a retry must assume it did."""

    problem_type = "urn:payorch:problem:commit-uncertain"


class UnencodableRequest(InvalidRequest):
    """The request has no single canonical JSON form: a string that is not valid UTF-8
    (a lone surrogate), a NaN or infinite number, an integer beyond ±(2**53 - 1), or an
    unordered set in an effect field. Refused before the claim; nothing was written."""

    problem_type = "urn:payorch:problem:unencodable-request"


class CorruptRecord(StorageError):
    """A stored row cannot be read back as what it should hold (bad JSON, state, time…).

    The operation exists, so something may have happened under its key: the client retries
    the same key later (after an operator repaired the row), never a new one. The reconciler
    quarantines such a row: flagged ``needs_attention``, a ``quarantined`` event, checked
    again only after a long pause.
    """

    problem_type = "urn:payorch:problem:corrupt-record"
    retry_after: float = 300.0

    def __init__(self, message: str, *, tenant_id: str, operation_id: str, problem: str) -> None:
        super().__init__(message, operation_id=operation_id)
        self.tenant_id = tenant_id
        self.problem = problem


class RequestBodyNotJson(InvalidRequest):
    """An HTTP request body that is not JSON (or not UTF-8, or holds a duplicate member
    name, NaN or Infinity): refused at the edge, before anything is validated or written."""

    problem_type = "urn:payorch:problem:request-body-not-json"


class WebhookUnstorable(WebhookMalformed):
    """A validly signed delivery that cannot be stored as it is: an event id, type or
    provider reference longer than its column, or text the database cannot hold (a NUL, a
    lone surrogate). Refused before anything is written: a provider that sends it again gets
    the same 400, never a 503 that would invite retries for ever."""

    problem_type = "urn:payorch:problem:webhook-unstorable"


class ListingUnsupported(InvalidRequest):
    """The named provider's adapter cannot list the effects it holds (it implements no
    :class:`~payorch.provider.EffectLister`), so no listing can be checked against it."""

    problem_type = "urn:payorch:problem:listing-unsupported"


class SettlementReportInvalid(InvalidRequest):
    """A settlement report that cannot be read as its format documents it (another format,
    a missing column, a truncated file, an unparsable amount or date): ``file``, ``row`` (the
    file's line number, the header is 1) and ``column`` say where. Nothing of the file is
    imported."""

    problem_type = "urn:payorch:problem:settlement-report-invalid"

    def __init__(
        self, message: str, *, file: str, row: int | None = None, column: str | None = None
    ) -> None:
        where = file if row is None else f"{file}, row {row}"
        if column is not None:
            where += f", column {column!r}"
        super().__init__(f"{where}: {message}")
        self.file = file
        self.row = row
        self.column = column


class SettlementAccountMismatch(InvalidRequest):
    """A settlement report of a merchant account other than the one it is imported for:
    refused, nothing imported."""

    problem_type = "urn:payorch:problem:settlement-account-mismatch"


class NoRoute(InvalidRequest):
    """No routing rule of the operation type matches the request's fields (currency,
    amount, tenant, the fields a rule names): nothing was stored, nothing sent. The request
    needs fixing, or the routing table a rule."""

    http_status = 422
    problem_type = "urn:payorch:problem:no-route"

    def __init__(self, message: str, *, operation: str) -> None:
        super().__init__(message)
        self.operation = operation


class ProviderListingFailed(ProviderError):
    """A page of the provider's effects could not be read (transport error, 429, 5xx, an
    unreadable body, or more pages than the listing's bound): nothing was decided from it.
    ``code`` says why (e.g. ``http_503``, ``ConnectError``, ``too_many_pages``)."""

    problem_type = "urn:payorch:problem:provider-listing-failed"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class InvalidMessage(InvalidRequest):
    """A message that cannot be stored as it is: an outbox payload with no JSON form, an
    empty or over-long type, aggregate or destination, a consumer's message with no id.
    Refused before anything is written."""

    problem_type = "urn:payorch:problem:invalid-message"


class MessageNotFound(OperationNotFound):
    """No outbox message with that id (in that tenant)."""

    problem_type = "urn:payorch:problem:message-not-found"


class EffectFailed(PayorchError):
    """The effect's recorded final failure (an exception its caller declared final), the
    same on every call under the key: fix the request; a new key is a new effect.
    ``error_type`` and ``error_message`` are what was recorded."""

    http_status = 422
    problem_type = "urn:payorch:problem:effect-failed"

    def __init__(
        self, message: str, *, effect_id: str, error_type: str, error_message: str
    ) -> None:
        super().__init__(message, operation_id=effect_id)
        self.effect_id = effect_id
        self.error_type = error_type
        self.error_message = error_message


class EffectOutcomeUnknown(PayorchError):
    """The effect may have happened and cannot be run again safely: it is escalated
    (``needs_attention``) and waits for an operator. Ask again with the same key later,
    never a new one."""

    http_status = 202
    problem_type = "urn:payorch:problem:effect-outcome-unknown"
    retry_after: float = 60.0

    def __init__(self, message: str, *, effect_id: str) -> None:
        super().__init__(message, operation_id=effect_id)
        self.effect_id = effect_id


class DeliveryFailed(PayorchError):
    """A sink did not take an outbox message (raised by a sink, handled by the relay): it is
    tried again after a backoff, or after ``retry_after`` seconds when the receiver said so,
    and dead-lettered after the relay's ``max_attempts``."""

    http_status = 502
    problem_type = "urn:payorch:problem:delivery-failed"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        # An unreadable or endless delay is no answer: the relay's own backoff decides.
        finite = retry_after is not None and math.isfinite(retry_after) and retry_after >= 0
        self.retry_after = retry_after if finite else None
