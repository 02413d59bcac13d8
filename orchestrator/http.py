"""The HTTP answer an embedding web app gives for an outcome or an error.

The mapping of the design's claim contract (IETF Idempotency-Key draft, Stripe):

=============================================  ======  ==================================
situation                                      status  notes
=============================================  ======  ==================================
succeeded (first time or replayed)             200     ``Idempotent-Replayed: true`` on a replay
declined / failed_final                        402     the stored failure, replayed alike
provider unavailable, nothing sent             503     a new key may be used
outcome_unknown                                202     body names the operation
in progress                                    409     ``Retry-After``
key reused with other effect fields            422
key past retention (tombstone)                 410     configurable per operation type
bad key / bad request                          400     422 for a request model's refusal
=============================================  ======  ==================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .core import State
from .errors import OperationInProgress, PayorchError
from .outcome import Outcome

__all__ = ["HttpAnswer", "http_answer"]

OPERATION_HEADER = "Payorch-Operation-Id"


@dataclass(frozen=True, kw_only=True)
class HttpAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def http_answer(result: Outcome | PayorchError) -> HttpAnswer:
    """What to send back for ``execute()``'s outcome or the PayorchError it raised."""
    if isinstance(result, PayorchError):
        headers: dict[str, str] = {}
        body: dict[str, Any] = {"error": type(result).__name__, "message": result.message}
        if result.operation_id is not None:
            headers[OPERATION_HEADER] = result.operation_id
            body["operation_id"] = result.operation_id
        if isinstance(result, OperationInProgress):
            headers["Retry-After"] = str(max(1, math.ceil(result.retry_after)))
        return HttpAnswer(status=result.http_status, body=body, headers=headers)
    headers = {OPERATION_HEADER: result.operation_id}
    if result.replayed:
        headers["Idempotent-Replayed"] = "true"
    if result.state is State.IN_PROGRESS:
        # Taken over mid-call (our lease lapsed): someone else is finishing it.
        headers["Retry-After"] = "1"
    body = {
        "operation_id": result.operation_id,
        "state": result.state.value,
        **{k: v for k, v in (result.response or {}).items() if k != "http_status"},
    }
    if result.unknown:
        body["message"] = (
            "the provider's answer is not known yet; it is being reconciled, "
            "ask again with the same idempotency key"
        )
    return HttpAnswer(status=result.http_status, body=body, headers=headers)
