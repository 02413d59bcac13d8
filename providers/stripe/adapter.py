"""The Stripe adapter: payorch operations as Stripe PaymentIntents and Refunds over httpx.

=================  ==================================================================
operation          Stripe call
=================  ==================================================================
payment.create     ``POST /v1/payment_intents`` (``confirm=true``)
payment.capture    ``POST /v1/payment_intents/{payload["payment_intent"]}/capture``
refund.create      ``POST /v1/refunds``
=================  ==================================================================

Every POST carries ``Idempotency-Key: <downstream key>``, identical on every attempt, and
``metadata[payorch_*]`` so that the effect can be found again without its id.

One ``submit`` or ``query_status`` runs under one total deadline (``max_call_duration``),
shared by every HTTP request it makes (a search and its reads, pages of refunds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from types import TracebackType
from typing import Any, Self

import httpx

from payorch.errors import ConfigurationError
from payorch.provider import (
    Answer,
    AnswerKind,
    StatusQuery,
    SubmitRequest,
    WebhookEvent,
    answer_from_transport_error,
    bounded_raw,
    call_budget,
    send_with_deadline,
)

from .classify import (
    PAYMENT_CAPTURE,
    PAYMENT_CREATE,
    REFUND_CREATE,
    Reply,
    failure_answer,
    object_answer,
    pick_answer,
)
from .forms import (
    STRIPE_ID,
    InvalidPayload,
    payment_intent_of,
    require_supported,
    search_query,
    submit_call,
)
from .webhooks import parse_stripe_webhook

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_WEBHOOK_TOLERANCE",
    "IDEMPOTENCY_WINDOW",
    "StripeProvider",
]

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=10.0, pool=5.0)
DEFAULT_WEBHOOK_TOLERANCE = timedelta(minutes=5)  # the tolerance Stripe's own libraries use
# Stripe prunes idempotency keys once they are at least 24 hours old.
IDEMPOTENCY_WINDOW = timedelta(hours=24)

_SEARCH_LIMIT = 10  # objects retrieved after a search; more than one is already an anomaly
_REFUND_PAGES = 10  # pages of 100 refunds listed per payment intent before giving up


class StripeProvider:
    """A :class:`payorch.provider.Provider` for Stripe's v1 API.

    ``payment.create`` creates and confirms a PaymentIntent. With ``capture_method="manual"``
    its effect is the authorisation, so ``requires_capture`` is that operation's SUCCEEDED
    and capturing is a separate ``payment.capture`` operation. Status queries never turn a
    refusal of the *query* into DECLINED: only an object's status decides an outcome.

    Pass ``transport`` (e.g. ``httpx.MockTransport``) or a whole ``client``; an injected client
    is not closed by :meth:`close`, and every request still uses this adapter's ``timeout``.
    """

    def __init__(
        self,
        *,
        api_key: str,
        webhook_secret: str | None = None,
        base_url: str = "https://api.stripe.com",
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        deadline: timedelta | None = None,
        webhook_tolerance: timedelta = DEFAULT_WEBHOOK_TOLERANCE,
        client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        stripe_version: str | None = None,
    ) -> None:
        if not api_key or not api_key.strip():
            raise ConfigurationError("Stripe api_key is empty")
        if webhook_secret is not None and not webhook_secret.strip():
            raise ConfigurationError(
                "Stripe webhook_secret is empty; pass None to disable webhooks"
            )
        if webhook_tolerance <= timedelta(0):
            # The stripe library reads a zero tolerance as "accept any age".
            raise ConfigurationError("webhook_tolerance must be positive")
        if client is not None and transport is not None:
            raise ConfigurationError("pass either client or transport, not both")
        try:
            # The bound of one submit or status query; by default every time-out phase.
            self._max_call_duration = deadline if deadline is not None else call_budget(timeout)
            url = httpx.URL(base_url)
        except (ValueError, httpx.InvalidURL) as exc:
            raise ConfigurationError(f"invalid Stripe adapter setting: {exc}") from exc
        seconds = self._max_call_duration.total_seconds()
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigurationError(f"the call deadline must be positive, not {deadline!r}")
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigurationError(f"Stripe base_url {base_url!r} is not an http(s) URL")
        self._base_url = str(url).rstrip("/")
        self._timeout = timeout
        self._webhook_secret = webhook_secret
        self._webhook_tolerance = webhook_tolerance
        self._headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json"}
        if stripe_version:
            self._headers["Stripe-Version"] = stripe_version
        self._owns_client = client is None
        self._client = client or httpx.Client(transport=transport, timeout=timeout)

    # -- the Provider protocol -------------------------------------------------------------

    @property
    def name(self) -> str:
        return "stripe"

    @property
    def idempotency_window(self) -> timedelta:
        return IDEMPOTENCY_WINDOW

    @property
    def max_call_duration(self) -> timedelta:
        return self._max_call_duration

    def submit(self, request: SubmitRequest) -> Answer:
        """Send ``request`` once with its downstream key and classify Stripe's answer.

        Raises ConfigurationError for an operation this adapter does not support and
        ProviderIdempotencyError when Stripe says the key was used with other parameters;
        everything else, transport failures included, comes back as an :class:`Answer`.
        """
        require_supported(request.operation)
        try:
            path, form = submit_call(request)
        except InvalidPayload as exc:
            # Nothing was sent; Stripe would have refused it with a 400 all the same.
            return Answer(kind=AnswerKind.DECLINED, code="invalid_payload", message=str(exc))
        reply = self._call(
            "POST",
            path,
            form=form,
            idempotency_key=request.downstream_key,
            deadline=self._deadline(),
        )
        if isinstance(reply, Answer):
            return reply
        failure = failure_answer(
            reply,
            query=False,
            operation_id=request.operation_id,
            downstream_key=request.downstream_key,
        )
        if failure is not None:
            return failure
        return object_answer(
            request.operation, reply.body, query=False, status_code=reply.status, reply=reply
        )

    def query_status(self, query: StatusQuery) -> Answer:
        """Ask Stripe where ``query``'s operation stands.

        By provider reference when there is one; otherwise payment.create searches by
        ``metadata['payorch_operation_id']`` (Search is eventually consistent: nothing found is
        NOT_FOUND), payment.capture reads ``payload["payment_intent"]`` and refund.create lists
        that intent's refunds. Transport errors, 429 and 5xx come back as they are.
        """
        require_supported(query.operation)
        deadline = self._deadline()
        reference = query.provider_reference
        if reference is not None:
            if not STRIPE_ID.fullmatch(reference):
                return Answer(
                    kind=AnswerKind.AMBIGUOUS,
                    code="invalid_reference",
                    message=f"stored provider reference {reference!r} is not a Stripe id",
                )
            is_refund = reference.startswith(("re_", "pyr_")) or (
                not reference.startswith("pi_") and query.operation == REFUND_CREATE
            )
            path = f"/v1/refunds/{reference}" if is_refund else f"/v1/payment_intents/{reference}"
            return self._retrieve(query, path, deadline)
        if query.operation == PAYMENT_CREATE:
            return self._search_intents(query, deadline)
        intent = self._payload_intent(query)
        if query.operation == PAYMENT_CAPTURE:
            return self._retrieve(query, f"/v1/payment_intents/{intent}", deadline)
        return self._list_refunds(query, intent, deadline)

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent:
        if self._webhook_secret is None:
            raise ConfigurationError("the Stripe adapter has no webhook_secret configured")
        return parse_stripe_webhook(
            headers, body, secret=self._webhook_secret, tolerance=self._webhook_tolerance
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- HTTP ----------------------------------------------------------------------------------

    def _deadline(self) -> float:
        """The monotonic instant by which the current submit or status query must end."""
        return time.monotonic() + self._max_call_duration.total_seconds()

    def _call(
        self,
        method: str,
        path: str,
        *,
        deadline: float,
        params: Mapping[str, str] | None = None,
        form: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> Reply | Answer:
        """One HTTP call; httpx errors become answers here and nowhere else."""
        headers = dict(self._headers)
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        try:
            request = self._client.build_request(
                method,
                self._base_url + path,
                params=params,
                data=form,
                headers=headers,
                timeout=self._timeout,
            )
            response = send_with_deadline(self._client, request, deadline=deadline)
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return Reply.from_response(response)

    def _retrieve(self, query: StatusQuery, path: str, deadline: float) -> Answer:
        reply = self._call("GET", path, deadline=deadline)
        if isinstance(reply, Answer):
            return reply
        failure = failure_answer(reply, query=True)
        if failure is not None:
            return failure
        return object_answer(
            query.operation,
            reply.body,
            query=True,
            status_code=reply.status,
            operation_id=query.operation_id,
            reply=reply,
        )

    def _payload_intent(self, query: StatusQuery) -> str:
        try:
            return payment_intent_of(query.payload)
        except InvalidPayload as exc:
            raise ConfigurationError(
                f"status query of {query.operation} without a provider reference needs "
                f"the operation's payload: {exc}",
                operation_id=query.operation_id,
            ) from exc

    def _list_page(
        self, path: str, params: Mapping[str, str], deadline: float
    ) -> tuple[Reply, dict[str, Any], list[dict[str, Any]]] | Answer:
        """One list or search page: the reply, its body and its objects, or the final answer."""
        reply = self._call("GET", path, params=params, deadline=deadline)
        if isinstance(reply, Answer):
            return reply
        failure = failure_answer(reply, query=True)
        if failure is not None:
            return failure
        data = reply.body.get("data") if reply.body is not None else None
        if reply.body is None or not isinstance(data, list):
            return Answer(
                kind=AnswerKind.AMBIGUOUS,
                status_code=reply.status,
                code="unexpected_body",
                message="a 2xx list reply without a data list",
                body=reply.body,
                raw=bounded_raw(reply.content) if reply.body is None else None,
            )
        return reply, reply.body, [item for item in data if isinstance(item, dict)]

    def _search_intents(self, query: StatusQuery, deadline: float) -> Answer:
        page = self._list_page(
            "/v1/payment_intents/search", {"query": search_query(query.operation_id)}, deadline
        )
        if isinstance(page, Answer):
            return page
        reply, body, items = page
        ids = [
            ident
            for ident in (item.get("id") for item in items)
            if isinstance(ident, str) and STRIPE_ID.fullmatch(ident)
        ]
        if not ids:
            return Answer(
                kind=AnswerKind.NOT_FOUND,
                status_code=reply.status,
                message="no PaymentIntent found by Search (it lags writes by up to a minute)",
                body=body,
            )
        # Search results may be stale; the status that decides comes from a fresh read.
        return _picked(
            [
                self._retrieve(query, f"/v1/payment_intents/{pi}", deadline)
                for pi in ids[:_SEARCH_LIMIT]
            ],
            ids,
        )

    def _list_refunds(self, query: StatusQuery, intent: str, deadline: float) -> Answer:
        params = {"payment_intent": intent, "limit": "100"}
        found: list[Answer] = []
        for _ in range(_REFUND_PAGES):
            page = self._list_page("/v1/refunds", params, deadline)
            if isinstance(page, Answer):
                return page
            reply, body, data = page
            for item in data:
                metadata = item.get("metadata")
                if isinstance(metadata, dict) and (
                    metadata.get("payorch_operation_id") == query.operation_id
                ):
                    found.append(
                        object_answer(
                            REFUND_CREATE,
                            item,
                            query=True,
                            status_code=reply.status,
                            operation_id=query.operation_id,
                        )
                    )
            last = data[-1].get("id") if data else None
            if body.get("has_more") is not True or not isinstance(last, str):
                if found:
                    return _picked(found)
                return Answer(
                    kind=AnswerKind.NOT_FOUND,
                    status_code=reply.status,
                    message=f"no refund of {intent} carries this operation id",
                    body=body,
                )
            params["starting_after"] = last
        if found:
            return _picked(found)
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            code="too_many_refunds",
            message=f"{intent} has more than {_REFUND_PAGES * 100} refunds; stopped listing",
        )


def _picked(answers: list[Answer], found: Sequence[str] = ()) -> Answer:
    """:func:`pick_answer`, naming every other object found for the operation in
    ``duplicates`` (``found``: what a search listed, even objects not read back)."""
    best = pick_answer(answers)
    refs = list(
        dict.fromkeys([*found, *(a.provider_reference for a in answers if a.provider_reference)])
    )
    if len(refs) < 2:
        return best
    primary = best.provider_reference or refs[0]
    return replace(best, duplicates=tuple(r for r in refs if r != primary))
