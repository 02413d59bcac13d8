"""The Stripe adapter: payorch operations as Stripe PaymentIntents and Refunds over httpx.

=================  ==================================================================
operation          Stripe call
=================  ==================================================================
payment.create     ``POST /v1/payment_intents`` (``confirm=true``)
payment.capture    ``POST /v1/payment_intents/{payload["payment_intent"]}/capture``
refund.create      ``POST /v1/refunds``
void (create)      ``POST /v1/payment_intents/{id}/cancel`` (:mod:`._voids`)
=================  ==================================================================

Every POST carries ``Idempotency-Key: <downstream key>``, identical on every attempt, and
``metadata[payorch_*]`` so that the effect can be found again without its id.

One ``submit`` or ``query_status`` runs under one total deadline (``max_call_duration``),
shared by every HTTP request it makes (a search and its reads, pages of refunds). What
each call does is a flow (:mod:`._flows`) that a sync and an async driver run alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta

import httpx

from ...clients import ClosesClients, HttpClients
from ...errors import ConfigurationError
from ...observing import _tracing as tracing
from ...provider import (
    DECIDING_HEADERS,
    Answer,
    Capability,
    ProviderEffect,
    StatusQuery,
    SubmitRequest,
    VoidRequest,
    WebhookEvent,
    WireRequest,
    answer_from_transport_error,
    asend_with_deadline,
    call_budget,
    send_with_deadline,
)
from ._classify import Reply
from ._flows import Call, Flow, query_flow, submit_answer, submit_flow
from ._listing import list_effects
from ._voids import void_flow
from ._webhooks import parse_stripe_webhook

__all__ = [
    "CAPABILITIES",
    "DEFAULT_TIMEOUT",
    "DEFAULT_WEBHOOK_TOLERANCE",
    "IDEMPOTENCY_WINDOW",
    "StripeProvider",
]

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=10.0, pool=5.0)
DEFAULT_WEBHOOK_TOLERANCE = timedelta(minutes=5)  # the tolerance Stripe's own libraries use
# Stripe prunes idempotency keys once they are at least 24 hours old.
IDEMPOTENCY_WINDOW = timedelta(hours=24)
# What the adapter can do to learn or settle an outcome. REPLAY: within the window, Stripe
# answers a repeat under the same Idempotency-Key with the first response; an endpoint
# configured without a window drops it.
CAPABILITIES = frozenset(
    {
        Capability.STATUS_BY_REFERENCE,
        Capability.STATUS_BY_KEY,
        Capability.REPLAY,
        Capability.VOID_BY_KEY,
        Capability.VOID_BY_REFERENCE,
        Capability.WEBHOOKS,
    }
)
# A re-sent request keeps the API version it was sent under: another version may read the
# same form otherwise.
_KEPT_HEADERS = DECIDING_HEADERS | {"stripe-version", "stripe-account"}


class StripeProvider(ClosesClients):
    """A :class:`payorch.provider.Provider` for Stripe's v1 API.

    ``payment.create`` creates and confirms a PaymentIntent. With ``capture_method="manual"``
    its effect is the authorisation, so ``requires_capture`` is that operation's SUCCEEDED
    and capturing is a separate ``payment.capture`` operation. Status queries never turn a
    refusal of the *query* into DECLINED: only an object's status decides an outcome.

    ``base_url`` and ``idempotency_window`` reach any Stripe-compatible endpoint: a window of
    None says the endpoint ignores Idempotency-Key (the reconciler then never re-submits).
    Pass ``transport`` (e.g. ``httpx.MockTransport``) or a whole ``client``; an injected client
    is not closed by :meth:`close`, and every request still uses this adapter's ``timeout``.
    It is also an :class:`payorch.provider.AsyncProvider` (``asubmit``, ``aquery_status``;
    ``async_client`` / ``async_transport``): one flow per call, driven sync or async.
    ``void`` / ``avoid`` cancel a payment.create's uncaptured PaymentIntent (a
    :class:`payorch.provider.Voider`); ``capabilities`` says so (:data:`CAPABILITIES`).
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
        async_client: httpx.AsyncClient | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        idempotency_window: timedelta | None = IDEMPOTENCY_WINDOW,
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
        if async_client is not None and async_transport is not None:
            raise ConfigurationError("pass either async_client or async_transport, not both")
        if idempotency_window is not None and idempotency_window <= timedelta(0):
            raise ConfigurationError(
                "idempotency_window must be positive; pass None for an endpoint that "
                "ignores Idempotency-Key"
            )
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
        self._idempotency_window = idempotency_window
        self._timeout = timeout
        self._webhook_secret = webhook_secret
        self._webhook_tolerance = webhook_tolerance
        self._headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json"}
        if stripe_version:
            self._headers["Stripe-Version"] = stripe_version
        self._clients = HttpClients(
            timeout=timeout,
            client=client,
            transport=transport,
            async_client=async_client,
            async_transport=async_transport,
        )

    # -- the Provider protocol -------------------------------------------------------------

    @property
    def name(self) -> str:
        return "stripe"

    @property
    def idempotency_window(self) -> timedelta | None:
        return self._idempotency_window

    @property
    def verifies_webhooks(self) -> bool:
        """Whether a delivery can be verified: built with its ``webhook_secret``."""
        return self._webhook_secret is not None

    @property
    def max_call_duration(self) -> timedelta:
        return self._max_call_duration

    @property
    def capabilities(self) -> frozenset[Capability]:
        """:data:`CAPABILITIES`, without REPLAY when the endpoint has no idempotency window."""
        if self._idempotency_window is None:
            return CAPABILITIES - {Capability.REPLAY}
        return CAPABILITIES

    def submit(self, request: SubmitRequest) -> Answer:
        """Send ``request`` once with its downstream key and classify Stripe's answer.

        Raises ConfigurationError for an operation this adapter does not support and
        ProviderIdempotencyError when Stripe says the key was used with other parameters;
        everything else, transport failures included, comes back as an :class:`Answer`.
        """
        if request.wire is not None:  # a re-send: the request as first sent
            client = self._clients.sync
            reply = self._send_built(client, self._rebuilt(client, request.wire))
            return submit_answer(request, reply)
        return self._run(submit_flow(request))

    def wire_request(self, request: SubmitRequest) -> WireRequest | Answer:
        """What :meth:`submit` sends for ``request``, or the answer it gives without
        sending: a :class:`payorch.provider.Resender`."""
        flow = submit_flow(request)
        try:
            call = next(flow)
        except StopIteration as refused:
            answer: Answer = refused.value
            return answer
        built = self._request(self._clients.sync, call)
        return WireRequest.of(built, keep=_KEPT_HEADERS)

    def _rebuilt(
        self, client: httpx.Client | httpx.AsyncClient, wire: WireRequest
    ) -> httpx.Request:
        headers = {k: v for k, v in self._headers.items() if k.lower() not in _KEPT_HEADERS}
        tracing.inject(headers)  # the current span's traceparent, when tracing is on
        return wire.build(client, base_url=self._base_url, headers=headers, timeout=self._timeout)

    def query_status(self, query: StatusQuery) -> Answer:
        """Ask Stripe where ``query``'s operation stands.

        By provider reference when there is one; otherwise payment.create searches by
        ``metadata['payorch_ref']``, the namespace's ref (Search is eventually consistent:
        nothing found is NOT_FOUND), payment.capture reads ``payload["payment_intent"]`` and
        refund.create lists that intent's refunds. Where Search is unavailable (a
        Stripe-compatible endpoint without it: 404, or a 400 saying so), payment.create lists
        the PaymentIntents created around the operation instead. Transport errors, 429 and
        5xx come back as they are.
        """
        return self._run(query_flow(query, window=self._idempotency_window))

    def void(self, request: VoidRequest) -> Answer:
        """Cancel the uncaptured PaymentIntent of ``request``'s payment.create (a
        :class:`payorch.provider.Voider`; the answers are :mod:`._voids`'). It is found as a
        status query finds it, then canceled under ``request.void_key``; any other operation
        is DECLINED ``not_voidable`` without a call. One deadline bounds it all."""
        return self._run(void_flow(request, window=self._idempotency_window))

    async def avoid(self, request: VoidRequest) -> Answer:
        """:meth:`void` over ``httpx.AsyncClient`` (the same flow, driven async)."""
        return await self._arun(void_flow(request, window=self._idempotency_window))

    def list_effects(self, since: datetime, until: datetime) -> Iterator[ProviderEffect]:
        """PaymentIntents and Refunds created in ``[since, until]`` that carry payorch's
        metadata (:mod:`._listing`): an :class:`payorch.provider.EffectLister`. Each page is
        one call under its own deadline; failures raise ``ProviderListingFailed``."""
        return list_effects(lambda call: self._call(call, self._deadline()), since, until)

    async def asubmit(self, request: SubmitRequest) -> Answer:
        """:meth:`submit` over ``httpx.AsyncClient`` (the same flow, driven async)."""
        if request.wire is not None:
            client = self._clients.asynchronous()
            built = self._rebuilt(client, request.wire)
            return submit_answer(request, await self._asend_built(client, built, self._deadline()))
        return await self._arun(submit_flow(request))

    async def aquery_status(self, query: StatusQuery) -> Answer:
        """:meth:`query_status` over ``httpx.AsyncClient`` (the same flow, driven async)."""
        return await self._arun(query_flow(query, window=self._idempotency_window))

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent:
        if self._webhook_secret is None:
            raise ConfigurationError("the Stripe adapter has no webhook_secret configured")
        return parse_stripe_webhook(
            headers, body, secret=self._webhook_secret, tolerance=self._webhook_tolerance
        )

    # -- HTTP: two drivers of one flow -----------------------------------------------------

    def _run(self, flow: Flow) -> Answer:
        """Make each call ``flow`` asks for with httpx.Client, under one total deadline."""
        deadline = self._deadline()
        try:
            call = next(flow)
            while True:
                call = flow.send(self._call(call, deadline))
        except StopIteration as done:
            answer: Answer = done.value
            return answer

    async def _arun(self, flow: Flow) -> Answer:
        """:meth:`_run` with httpx.AsyncClient."""
        deadline = self._deadline()
        try:
            call = next(flow)
            while True:
                call = flow.send(await self._acall(call, deadline))
        except StopIteration as done:
            answer: Answer = done.value
            return answer

    def _deadline(self) -> float:
        """The monotonic instant by which the current submit or status query must end."""
        return time.monotonic() + self._max_call_duration.total_seconds()

    def _request(self, client: httpx.Client | httpx.AsyncClient, call: Call) -> httpx.Request:
        headers = dict(self._headers)
        if call.idempotency_key is not None:
            headers["Idempotency-Key"] = call.idempotency_key
        tracing.inject(headers)  # the current span's traceparent, when tracing is on
        return client.build_request(
            call.method,
            self._base_url + call.path,
            params=call.params,
            data=call.form,
            headers=headers,
            timeout=self._timeout,
        )

    def _call(self, call: Call, deadline: float) -> Reply | Answer:
        """One HTTP call; httpx errors become answers here and nowhere else."""
        client = self._clients.sync
        return self._send_built(client, self._request(client, call), deadline)

    async def _acall(self, call: Call, deadline: float) -> Reply | Answer:
        client = self._clients.asynchronous()
        return await self._asend_built(client, self._request(client, call), deadline)

    def _send_built(
        self, client: httpx.Client, request: httpx.Request, deadline: float | None = None
    ) -> Reply | Answer:
        try:
            response = send_with_deadline(
                client, request, deadline=deadline if deadline is not None else self._deadline()
            )
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return Reply.from_response(response)

    async def _asend_built(
        self, client: httpx.AsyncClient, request: httpx.Request, deadline: float
    ) -> Reply | Answer:
        try:
            response = await asend_with_deadline(client, request, deadline=deadline)
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return Reply.from_response(response)
