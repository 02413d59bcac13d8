"""The HTTP answer an embedding web app gives for an outcome or an error.

The mapping of the design's claim contract (IETF Idempotency-Key draft, Stripe). Every
answer says what the client does next; ``retry`` in the body spells it out where it matters:

=============================================  ======  =========================================
situation                                      status  next step (``retry``)
=============================================  ======  =========================================
succeeded (first time or replayed)             200     ``Idempotent-Replayed: true`` on a replay
declined / failed_final                        402     the stored failure, replayed alike
failed_final, nothing sent (provider down,     503     ``new_key``: the only answer that allows
provider refused our credentials, abandoned)           one; ``Retry-After``
outcome_unknown                                202     ``same_key``: body names the operation
in progress                                    409     ``same_key`` after ``Retry-After``
key reused with other effect fields            422     type ``…:idempotency-key-reused``
request model refused the payload              422     type ``…:request-validation-failed``
key past retention (tombstone)                 410     configurable per operation type
bad key / bad request / unknown provider       400
storage failed before the claim could commit   503     ``same_key`` after ``Retry-After``
storage failed once the claim may have         503     ``same_key`` after ``Retry-After``: the
committed (``OutcomeNotRecorded``)                     operation may exist and may have been sent
=============================================  ======  =========================================

Why 503 and not 202 when the outcome was not recorded: a 202 says the request was
accepted, and after a lost COMMIT it may not have been; a 503 with ``Retry-After`` makes
every client come back, and its ``type`` and ``retry`` say "with the same key". Every
error body carries the error's stable ``type`` URN, so two 422s are told apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .core import State
from .errors import OperationInProgress, OutcomeNotRecorded, PayorchError, StorageError
from .outcome import Outcome

__all__ = ["HttpAnswer", "http_answer"]

OPERATION_HEADER = "Payorch-Operation-Id"
# A stored "nothing was sent" failure keeps no provider Retry-After; its inline retries
# already waited, so a client should not come straight back.
FAILED_NOT_SENT_RETRY_AFTER = 5
SAME_KEY = "same_key"
NEW_KEY = "new_key"

_STORAGE_MESSAGE = (
    "storage is unavailable; retry with the same idempotency key after Retry-After seconds, "
    "never with a new one"
)
_NOT_RECORDED_MESSAGE = (
    "the operation may exist and may have reached the provider, but its outcome is not "
    "recorded yet; retry with the same idempotency key after Retry-After seconds, never "
    "with a new one"
)


@dataclass(frozen=True, kw_only=True)
class HttpAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def _seconds(value: float) -> str:
    return str(max(1, math.ceil(value)))


def _error_answer(err: PayorchError) -> HttpAnswer:
    headers: dict[str, str] = {}
    body: dict[str, Any] = {
        "type": err.problem_type,
        "error": type(err).__name__,
        "message": err.message,
    }
    if err.operation_id is not None:
        headers[OPERATION_HEADER] = err.operation_id
        body["operation_id"] = err.operation_id
    if isinstance(err, OperationInProgress):
        headers["Retry-After"] = _seconds(err.retry_after)
        body["retry"] = SAME_KEY
    if isinstance(err, StorageError):
        # Never the database's own text (hosts, SQL) to a client; it stays on the exception.
        not_recorded = isinstance(err, OutcomeNotRecorded)
        body["message"] = _NOT_RECORDED_MESSAGE if not_recorded else _STORAGE_MESSAGE
        headers["Retry-After"] = _seconds(err.retry_after)
        body["retry"] = SAME_KEY
    if err.http_status == 503 and "Retry-After" not in headers:  # every 503 says when
        headers["Retry-After"] = "1"
    return HttpAnswer(status=err.http_status, body=body, headers=headers)


def http_answer(result: Outcome | PayorchError) -> HttpAnswer:
    """What to send back for ``execute()``'s outcome or the PayorchError it raised."""
    if isinstance(result, PayorchError):
        return _error_answer(result)
    headers = {OPERATION_HEADER: result.operation_id}
    if result.replayed:
        headers["Idempotent-Replayed"] = "true"
    body: dict[str, Any] = {
        "operation_id": result.operation_id,
        "state": result.state.value,
        **{k: v for k, v in (result.response or {}).items() if k != "http_status"},
    }
    if result.state is State.IN_PROGRESS:
        # Taken over mid-call (our lease lapsed): someone else is finishing it.
        headers["Retry-After"] = "1"
        body["retry"] = SAME_KEY
    if result.unknown:
        body["message"] = (
            "the provider's answer is not known yet; it is being reconciled, "
            "ask again with the same idempotency key"
        )
        body["retry"] = SAME_KEY
    if result.http_status == 503:
        # Stored failed_final with nothing sent: this key's answer is final, and a new key is
        # safe because no request reached the provider.
        headers["Retry-After"] = str(FAILED_NOT_SENT_RETRY_AFTER)
        body["retry"] = NEW_KEY if result.state is State.FAILED_FINAL else SAME_KEY
    return HttpAnswer(status=result.http_status, body=body, headers=headers)
