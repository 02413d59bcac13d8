"""What a web endpoint sends back for an effect's answer: the HTTP mapping of payments.

Errors go through :func:`payorch.http.http_answer` (RFC 9457 problem+json, the error's
``http_status``); on top of it an escalated effect (202) says when to ask again with the
same key, and a recorded failure (422) names its ``error_type``. A result is 200 with the
stored value, ``Idempotent-Replayed: true`` on a replay.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..errors import EffectFailed, EffectOutcomeUnknown, PayorchError
from ..http import OPERATION_HEADER, REPLAYED_HEADER, SAME_KEY, HttpAnswer, http_answer
from ._values import EffectResult

__all__ = ["effect_answer"]


def effect_answer(result: EffectResult | PayorchError) -> HttpAnswer:
    """The answer for an effect's result, or for the PayorchError a call raised."""
    if isinstance(result, PayorchError):
        answer = http_answer(result)
        if isinstance(result, EffectOutcomeUnknown):
            seconds = str(max(1, math.ceil(result.retry_after)))
            return replace(
                answer,
                headers={**answer.headers, "Retry-After": seconds},
                body={**answer.body, "retry": SAME_KEY},
            )
        if isinstance(result, EffectFailed):
            return replace(answer, body={**answer.body, "error_type": result.error_type})
        return answer
    headers = {OPERATION_HEADER: result.effect_id}
    if result.replayed:
        headers[REPLAYED_HEADER] = "true"
    body = {"effect_id": result.effect_id, "result": result.value}
    return HttpAnswer(status=200, body=body, headers=headers)
