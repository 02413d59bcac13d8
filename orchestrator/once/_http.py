"""What a web endpoint sends back for an effect's answer: the HTTP mapping of payments.

Errors go through :func:`payorch.http.http_answer` (RFC 9457 problem+json, the error's
``http_status``: an escalated effect is 202 with ``Retry-After`` and ``retry: same_key``, a
recorded failure 422 naming its ``error_type``). A result is 200 with the stored value,
``Idempotent-Replayed: true`` on a replay.
"""

from __future__ import annotations

from ..errors import PayorchError
from ..http import OPERATION_HEADER, REPLAYED_HEADER, HttpAnswer, http_answer
from ._values import EffectResult

__all__ = ["effect_answer"]


def effect_answer(result: EffectResult | PayorchError) -> HttpAnswer:
    """The answer for an effect's result, or for the PayorchError a call raised."""
    if isinstance(result, PayorchError):
        return http_answer(result)
    headers = {OPERATION_HEADER: result.effect_id}
    if result.replayed:
        headers[REPLAYED_HEADER] = "true"
    body = {"effect_id": result.effect_id, "result": result.value}
    return HttpAnswer(status=200, body=body, headers=headers)
