"""The Adyen adapter: payorch operations as Adyen Checkout calls over httpx.

Every POST carries ``X-API-Key``, ``Idempotency-Key: <downstream key>`` (identical on every
attempt; Adyen honours it for at least 31 days) and, for a payment, ``reference`` = the
downstream key, which is what a technical cancel (``POST /cancels``) and the notifications
find the payment by. Adyen has no status read: outcomes that a reply does not settle arrive
by notification (:mod:`._notifications`), and a repeat of the identical request under the
same key answers the first outcome (``REPLAY``).

Request building (:mod:`._requests`) and classification (:mod:`._classify`) are pure and
shared by the sync and async calls; only the sending differs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import httpx

from ...clients import ClosesClients, HttpClients
from ...errors import ConfigurationError, WebhookRejected
from ...observing import _tracing as tracing
from ...provider import (
    DECIDING_HEADERS,
    Answer,
    AnswerKind,
    Capability,
    StatusQuery,
    SubmitRequest,
    VoidRequest,
    WebhookBatch,
    WebhookEvent,
    WireRequest,
    answer_from_transport_error,
    asend_with_deadline,
    call_budget,
    send_with_deadline,
)
from ._classify import Reply, modification_answer, payment_answer
from ._notifications import decode_hmac_key, parse_notifications
from ._requests import Call, InvalidPayload, require_supported, submit_call, void_call

__all__ = ["CAPABILITIES", "DEFAULT_TIMEOUT", "IDEMPOTENCY_WINDOW", "AdyenProvider"]

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=10.0, pool=5.0)
# Adyen: keys are "valid for a minimum period of 31 days after first submission".
IDEMPOTENCY_WINDOW = timedelta(days=31)
CAPABILITIES = frozenset(
    {
        Capability.REPLAY,
        Capability.VOID_BY_KEY,
        Capability.VOID_BY_REFERENCE,
        Capability.WEBHOOKS,
    }
)

_Classifier = Callable[[Reply], Answer]
_Builder = Callable[[httpx.Client | httpx.AsyncClient], httpx.Request]


class AdyenProvider(ClosesClients):
    """A :class:`payorch.provider.Provider` for Adyen's Checkout API (v71 shapes).

    ``base_url`` is the Checkout endpoint including its version (e.g. ``…/v71``): Adyen's
    live URL carries the merchant's own prefix, so there is no default. ``hmac_key`` is the
    notification HMAC key as hex (None: notifications are not verified here, and parsing
    them raises ConfigurationError). ``return_url`` is sent as ``returnUrl`` unless the
    payload brings its own; ``default_currency`` completes a capture or refund whose
    payload names no currency (Adyen needs one; payorch's built-in capture has none).

    It is also an :class:`payorch.provider.AsyncProvider`, a :class:`~payorch.provider.Voider`
    (``void``/``avoid``) and a :class:`~payorch.provider.BatchWebhooks`. An injected client
    or transport is the caller's and is not closed by :meth:`close`.
    """

    capabilities = CAPABILITIES

    def __init__(
        self,
        *,
        api_key: str,
        merchant_account: str,
        base_url: str,
        hmac_key: str | None = None,
        return_url: str | None = None,
        default_currency: str | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        deadline: timedelta | None = None,
        client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        async_client: httpx.AsyncClient | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not api_key or not api_key.strip():
            raise ConfigurationError("Adyen api_key is empty")
        if not merchant_account or not merchant_account.strip():
            raise ConfigurationError("Adyen merchant_account is empty")
        self._hmac_key = decode_hmac_key(hmac_key) if hmac_key is not None else None
        if client is not None and transport is not None:
            raise ConfigurationError("pass either client or transport, not both")
        if async_client is not None and async_transport is not None:
            raise ConfigurationError("pass either async_client or async_transport, not both")
        if default_currency is not None and not (
            len(default_currency) == 3 and default_currency.isascii() and default_currency.isalpha()
        ):
            raise ConfigurationError(f"default_currency {default_currency!r} is not ISO 4217")
        try:
            self._max_call_duration = deadline if deadline is not None else call_budget(timeout)
            url = httpx.URL(base_url)
        except (ValueError, httpx.InvalidURL) as exc:
            raise ConfigurationError(f"invalid Adyen adapter setting: {exc}") from exc
        seconds = self._max_call_duration.total_seconds()
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigurationError(f"the call deadline must be positive, not {deadline!r}")
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigurationError(f"Adyen base_url {base_url!r} is not an http(s) URL")
        self._base_url = str(url).rstrip("/")
        self._merchant_account = merchant_account
        self._return_url = return_url
        self._default_currency = default_currency
        self._timeout = timeout
        self._headers = {
            "X-API-Key": api_key,
            "Accept": "application/json",
            "Content-Type": "application/json",
        }
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
        return "adyen"

    @property
    def idempotency_window(self) -> timedelta | None:
        return IDEMPOTENCY_WINDOW

    @property
    def merchant_account(self) -> str:
        """The merchant account it pays into (a settlement report of another is refused)."""
        return self._merchant_account

    @property
    def verifies_webhooks(self) -> bool:
        """Whether a delivery can be verified: built with its ``hmac_key``."""
        return self._hmac_key is not None

    @property
    def max_call_duration(self) -> timedelta:
        return self._max_call_duration

    def submit(self, request: SubmitRequest) -> Answer:
        """Send ``request`` once with its downstream key and classify Adyen's answer.

        Raises ConfigurationError for an operation this adapter does not support; a payload
        Adyen could not take is refused before sending (NOT_SENT, ``invalid_request``), and
        everything else, transport failures included, comes back as an :class:`Answer`.
        """
        if request.wire is not None:  # a re-send: the request as first sent
            wire = request.wire
            return self._send_built(lambda c: self._rebuilt(c, wire), _classifier(wire))
        prepared = self._prepare_submit(request)
        if isinstance(prepared, Answer):
            return prepared
        return self._send(*prepared)

    async def asubmit(self, request: SubmitRequest) -> Answer:
        """:meth:`submit` over ``httpx.AsyncClient``."""
        if request.wire is not None:
            wire = request.wire
            return await self._asend_built(lambda c: self._rebuilt(c, wire), _classifier(wire))
        prepared = self._prepare_submit(request)
        if isinstance(prepared, Answer):
            return prepared
        return await self._asend(*prepared)

    def wire_request(self, request: SubmitRequest) -> WireRequest | Answer:
        """What :meth:`submit` sends for ``request`` (with this adapter's merchant account,
        return URL and default currency), or the refusal it answers: a
        :class:`payorch.provider.Resender`."""
        prepared = self._prepare_submit(request)
        if isinstance(prepared, Answer):
            return prepared
        built = self._request(self._clients.sync, prepared[0])
        return WireRequest.of(built)

    def query_status(self, query: StatusQuery) -> Answer:
        """Adyen cannot be asked where a payment stands: AMBIGUOUS, ``status_unsupported``
        (no HTTP call). Outcomes come from replies, replays and notifications."""
        return _status_unsupported(query)

    async def aquery_status(self, query: StatusQuery) -> Answer:
        return _status_unsupported(query)

    def void(self, request: VoidRequest) -> Answer:
        """Cancel the payment ``request`` may have authorised: by its pspReference when
        known, else by its reference (a technical cancel). PENDING once Adyen took it (the
        CANCELLATION or TECHNICAL_CANCEL notification settles it); a 422 saying it cannot be
        cancelled is DECLINED with Adyen's code."""
        prepared = self._prepare_void(request)
        if isinstance(prepared, Answer):
            return prepared
        return self._send(*prepared)

    async def avoid(self, request: VoidRequest) -> Answer:
        """:meth:`void` over ``httpx.AsyncClient``."""
        prepared = self._prepare_void(request)
        if isinstance(prepared, Answer):
            return prepared
        return await self._asend(*prepared)

    def parse_webhooks(self, headers: Mapping[str, str], body: bytes) -> WebhookBatch:
        """Every item of a notification delivery, each verified on its own and refused unless
        it is for this adapter's merchant account; answer ``[accepted]`` once taken. Raises
        WebhookMalformed for a body that is not one."""
        return parse_notifications(body, self._require_hmac_key(), self._merchant_account)

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent:
        """The first item of a delivery as one event; its rejection is raised."""
        item = self.parse_webhooks(headers, body).items[0]
        if item.rejected is not None:
            raise item.rejected
        if item.event is None:  # pragma: no cover - a WebhookItem is one or the other
            raise WebhookRejected("the notification item carries no event")
        return item.event

    # -- shared request building -----------------------------------------------------------

    def _require_hmac_key(self) -> bytes:
        if self._hmac_key is None:
            raise ConfigurationError("the Adyen adapter has no hmac_key configured")
        return self._hmac_key

    def _prepare_submit(self, request: SubmitRequest) -> tuple[Call, _Classifier] | Answer:
        require_supported(request.operation)
        try:
            call = submit_call(
                request,
                merchant_account=self._merchant_account,
                return_url=self._return_url,
                default_currency=self._default_currency,
            )
        except InvalidPayload as exc:
            return _refused(exc)
        classify = payment_answer if call.path == "/payments" else modification_answer
        return call, classify

    def _prepare_void(self, request: VoidRequest) -> tuple[Call, _Classifier] | Answer:
        try:
            call = void_call(request, merchant_account=self._merchant_account)
        except InvalidPayload as exc:
            return _refused(exc)
        return call, _void_answer

    # -- HTTP: the only part that differs between sync and async ----------------------------

    def _request(self, client: httpx.Client | httpx.AsyncClient, call: Call) -> httpx.Request:
        headers = dict(self._headers)
        headers["Idempotency-Key"] = call.idempotency_key
        tracing.inject(headers)  # the current span's traceparent, when tracing is on
        return client.build_request(
            "POST",
            self._base_url + call.path,
            json=call.json,
            headers=headers,
            timeout=self._timeout,
        )

    def _deadline(self) -> float:
        return time.monotonic() + self._max_call_duration.total_seconds()

    def _rebuilt(
        self, client: httpx.Client | httpx.AsyncClient, wire: WireRequest
    ) -> httpx.Request:
        headers = {k: v for k, v in self._headers.items() if k.lower() not in DECIDING_HEADERS}
        tracing.inject(headers)  # the current span's traceparent, when tracing is on
        return wire.build(client, base_url=self._base_url, headers=headers, timeout=self._timeout)

    def _send(self, call: Call, classify: _Classifier) -> Answer:
        return self._send_built(lambda client: self._request(client, call), classify)

    async def _asend(self, call: Call, classify: _Classifier) -> Answer:
        return await self._asend_built(lambda client: self._request(client, call), classify)

    def _send_built(self, build: _Builder, classify: _Classifier) -> Answer:
        """One HTTP call under the call deadline; httpx errors become answers here."""
        deadline = self._deadline()
        try:
            client = self._clients.sync
            response = send_with_deadline(client, build(client), deadline=deadline)
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return classify(Reply.from_response(response))

    async def _asend_built(self, build: _Builder, classify: _Classifier) -> Answer:
        deadline = self._deadline()
        client = self._clients.asynchronous()
        try:
            response = await asend_with_deadline(client, build(client), deadline=deadline)
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return classify(Reply.from_response(response))


def _classifier(wire: WireRequest) -> _Classifier:
    """How a submission's answer reads: a payment's, or a modification's (by its path)."""
    payment = httpx.URL(wire.url).path.endswith("/payments")
    return payment_answer if payment else modification_answer


def _void_answer(reply: Reply) -> Answer:
    return modification_answer(reply, void=True)


def _refused(exc: InvalidPayload) -> Answer:
    # Nothing was sent: this request can never be (outcome.REFUSED_BEFORE_SENDING).
    return Answer(kind=AnswerKind.NOT_SENT, code="invalid_request", message=str(exc))


def _status_unsupported(query: StatusQuery) -> Answer:
    return Answer(
        kind=AnswerKind.AMBIGUOUS,
        provider_reference=query.provider_reference,
        code="status_unsupported",
        message="Adyen has no payment status read: the outcome arrives by notification, "
        "or by a replay of the identical request under the same key",
    )
