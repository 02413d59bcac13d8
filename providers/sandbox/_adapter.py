"""The sandbox acquirer's adapter: implements :class:`payorch.provider.Provider`.

Every httpx exception is caught here, once, and classified by
:func:`payorch.provider.answer_from_transport_error`; nothing from httpx escapes. Every
call runs under :func:`payorch.provider.send_with_deadline`, so ``max_call_duration``
(the deadline) bounds it whatever the server does.

It is also a :class:`payorch.provider.AsyncProvider` (``asubmit``, ``aquery_status``) over
``httpx.AsyncClient``: the requests are built and the answers classified by the same code;
only the sending differs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from standardwebhooks.webhooks import (
    EmptyWebhookSecretError,
    Webhook,
    WebhookVerificationError,
)

from ...clients import ClosesClients, HttpClients
from ...errors import (
    ConfigurationError,
    WebhookMalformed,
    WebhookSignatureInvalid,
)
from ...observing import _tracing as tracing
from ...provider import (
    TAG_LEGACY_OPERATION_ID,
    Answer,
    AnswerKind,
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
    listing_failed,
    listing_range,
    send_with_deadline,
    unix_time,
)
from ._classify import (
    EVENT_KINDS,
    VOIDED,
    classify_query,
    classify_submit,
    classify_void,
    error_of,
    listed_effect,
    read_reply,
    str_or_none,
)

__all__ = ["DEFAULT_TIMEOUT", "SandboxProvider"]

DEFAULT_TIMEOUT = httpx.Timeout(connect=2.0, read=5.0, write=5.0, pool=2.0)
_LIST_PAGE = 100  # effects per page of list_effects (the sandbox's maximum)
MAX_LIST_PAGES = 100  # then list_effects gives up: a narrower window lists the rest


class SandboxProvider(ClosesClients):
    """Talks to :class:`payorch.providers.sandbox.SandboxServer` (or anything with its API)."""

    def __init__(
        self,
        *,
        base_url: str,
        webhook_secret: str | None = None,
        idempotency_window: timedelta | None = timedelta(hours=24),
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        deadline: timedelta | None = None,
        client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        name: str = "sandbox",
        async_client: httpx.AsyncClient | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        # The whole call's bound; by default every time-out phase added up.
        budget = call_budget(timeout)  # refuses a time-out phase left None
        self._deadline = deadline if deadline is not None else budget
        seconds = self._deadline.total_seconds()
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigurationError(f"the call deadline must be positive, not {deadline!r}")
        if client is not None and transport is not None:
            raise ValueError("pass client or transport, not both")
        if async_client is not None and async_transport is not None:
            raise ValueError("pass async_client or async_transport, not both")
        try:
            parsed = httpx.URL(base_url)
        except httpx.InvalidURL as exc:
            raise ConfigurationError(f"invalid sandbox base_url {base_url!r}") from exc
        port_ok = parsed.port is None or 0 < parsed.port < 65536
        if parsed.scheme not in ("http", "https") or not parsed.host or not port_ok:
            raise ConfigurationError(
                f"sandbox base_url must be http(s)://host[:port], not {base_url!r}"
            )
        self._base_url = str(parsed).rstrip("/")
        self._timeout = timeout
        self._idempotency_window = idempotency_window
        self._name = name
        self._webhook: Webhook | None = None
        if webhook_secret is not None:
            try:
                self._webhook = Webhook(webhook_secret)
            except (ValueError, EmptyWebhookSecretError) as exc:  # ValueError: bad base64
                raise ConfigurationError("the sandbox webhook secret is not valid") from exc
        # The time-out is also passed on every request, so a caller's client cannot loosen it.
        self._clients = HttpClients(
            timeout=timeout,
            client=client,
            transport=transport,
            async_client=async_client,
            async_transport=async_transport,
        )

    # -- Provider --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def idempotency_window(self) -> timedelta | None:
        return self._idempotency_window

    @property
    def verifies_webhooks(self) -> bool:
        """Whether a delivery can be verified: built with its ``webhook_secret``."""
        return self._webhook is not None

    @property
    def max_call_duration(self) -> timedelta:
        return self._deadline

    @property
    def capabilities(self) -> frozenset[Capability]:
        # The sandbox honours its key for a window, so a repeat answers the first outcome.
        return _CAPABILITIES

    def void(self, request: VoidRequest) -> Answer:
        """Void by the payment's key (``POST /v1/voids``): see :class:`~payorch.provider.Voider`."""
        try:
            response = self._send(self._void_request(self._clients.sync, request))
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return classify_void(response)

    async def avoid(self, request: VoidRequest) -> Answer:
        try:
            response = await self._asend(self._void_request(self._clients.asynchronous(), request))
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return classify_void(response)

    def _void_request(
        self, client: httpx.Client | httpx.AsyncClient, request: VoidRequest
    ) -> httpx.Request:
        return client.build_request(
            "POST",
            f"{self._base_url}/v1/voids",
            json={"idempotency_key": request.downstream_key},
            headers=tracing.inject({"Idempotency-Key": request.void_key}),
            timeout=self._timeout,
        )

    def submit(self, request: SubmitRequest) -> Answer:
        """Send ``request`` (its ``wire`` as it is, when set) and classify the answer."""
        try:
            response = self._send(self._outgoing(self._clients.sync, request))
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return classify_submit(response, request)

    def wire_request(self, request: SubmitRequest) -> WireRequest:
        """What :meth:`submit` sends for ``request`` (a :class:`payorch.provider.Resender`)."""
        built = self._submit_request(self._clients.sync, request)
        return WireRequest.of(built)

    def _outgoing(
        self, client: httpx.Client | httpx.AsyncClient, request: SubmitRequest
    ) -> httpx.Request:
        """``request.wire`` as it is (a re-send), else the request built now."""
        if request.wire is None:
            return self._submit_request(client, request)
        headers = tracing.inject({})  # the current span's traceparent
        return request.wire.build(
            client, base_url=self._base_url, headers=headers, timeout=self._timeout
        )

    def query_status(self, query: StatusQuery) -> Answer:
        try:
            response = self._send(self._query_request(self._clients.sync, query))
        except httpx.HTTPError as exc:
            # NOT_SENT or AMBIGUOUS: for a read both only mean "unavailable, ask later".
            return answer_from_transport_error(exc)
        return classify_query(response, by_reference=bool(query.provider_reference))

    # -- EffectLister ------------------------------------------------------------------------

    def list_effects(self, since: datetime, until: datetime) -> Iterator[ProviderEffect]:
        """The ledger's visible effects created in ``[since, until]``, a page per request
        (each under its own deadline), in commit order. ``ProviderListingFailed`` when a page
        cannot be read or more than ``MAX_LIST_PAGES`` would be needed."""
        start, end = listing_range(since, until)
        params = {"created[gte]": str(start), "created[lte]": str(end), "limit": str(_LIST_PAGE)}
        for _ in range(MAX_LIST_PAGES):
            data, more = self._list_page(params)
            for item in data:
                yield listed_effect(self._name, item)
            if not more or not data:
                return
            params["starting_after"] = str(data[-1]["id"])
        raise listing_failed(
            self._name,
            Answer(
                kind=AnswerKind.AMBIGUOUS,
                code="too_many_pages",
                message=f"more than {MAX_LIST_PAGES * _LIST_PAGE} effects; narrow the window",
            ),
        )

    def _list_page(self, params: Mapping[str, str]) -> tuple[list[dict[str, Any]], bool]:
        url = f"{self._base_url}/v1/effects?{urlencode(params)}"
        request = self._clients.sync.build_request(
            "GET", url, headers=tracing.inject({}), timeout=self._timeout
        )
        try:
            response = self._send(request)
        except httpx.HTTPError as exc:
            raise listing_failed(self._name, answer_from_transport_error(exc)) from exc
        status, body, evidence, shared = read_reply(response)
        if shared is not None:
            raise listing_failed(self._name, shared)
        data = body.get("data") if body is not None else None
        if status != 200 or not isinstance(data, list) or not isinstance(body, dict):
            code = str_or_none(error_of(body).get("code")) or f"http_{status}"
            answer = Answer(kind=AnswerKind.AMBIGUOUS, code=code, **evidence)
            raise listing_failed(self._name, answer)
        return data, body.get("has_more") is True

    # -- AsyncProvider: the same requests and classification, sent by httpx.AsyncClient --

    async def asubmit(self, request: SubmitRequest) -> Answer:
        client = self._clients.asynchronous()
        try:
            response = await self._asend(self._outgoing(client, request))
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return classify_submit(response, request)

    async def aquery_status(self, query: StatusQuery) -> Answer:
        client = self._clients.asynchronous()
        try:
            response = await self._asend(self._query_request(client, query))
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return classify_query(response, by_reference=bool(query.provider_reference))

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent:
        if self._webhook is None:
            raise ConfigurationError("no webhook secret configured for the sandbox provider")
        lowered = {k.lower(): v for k, v in headers.items()}
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WebhookSignatureInvalid("webhook body is not UTF-8; cannot verify") from exc
        try:
            self._webhook.verify(text, lowered, json_parse=False)
        except (WebhookVerificationError, ValueError) as exc:
            # ValueError: a malformed signature list or base64 inside the header.
            raise WebhookSignatureInvalid(f"webhook signature rejected: {exc}") from exc
        try:
            event = json.loads(text)
        except ValueError as exc:
            raise WebhookMalformed("webhook body is not JSON") from exc
        return self._event_from(event, lowered)

    def _submit_request(
        self, client: httpx.Client | httpx.AsyncClient, request: SubmitRequest
    ) -> httpx.Request:
        payload = dict(request.payload)
        extra = payload.get("metadata")
        metadata = dict(extra) if isinstance(extra, Mapping) else {}
        tags = request.tags  # from the namespace alone, as the downstream key
        if TAG_LEGACY_OPERATION_ID in tags:
            # Claimed before keys came from the namespace: what its first request carried.
            tags = {"operation_id": request.operation_id, "tenant_id": request.tenant_id}
        metadata.update(tags)
        payload["metadata"] = metadata
        return client.build_request(
            "POST",
            f"{self._base_url}/v1/operations/{quote(request.operation, safe='')}",
            json=payload,
            # The current span's traceparent: the provider's logs join our trace.
            headers=tracing.inject({"Idempotency-Key": request.downstream_key}),
            timeout=self._timeout,
        )

    def _query_request(
        self, client: httpx.Client | httpx.AsyncClient, query: StatusQuery
    ) -> httpx.Request:
        if query.provider_reference:
            url = f"{self._base_url}/v1/effects/{quote(query.provider_reference, safe='')}"
        else:
            # The query in the URL itself: httpx then parses the URL once, not twice.
            search = urlencode({"idempotency_key": query.downstream_key})
            url = f"{self._base_url}/v1/effects?{search}"
        return client.build_request("GET", url, headers=tracing.inject({}), timeout=self._timeout)

    def _send(self, request: httpx.Request) -> httpx.Response:
        return send_with_deadline(
            self._clients.sync, request, deadline=time.monotonic() + self._deadline.total_seconds()
        )

    async def _asend(self, request: httpx.Request) -> httpx.Response:
        return await asend_with_deadline(
            self._clients.asynchronous(),
            request,
            deadline=time.monotonic() + self._deadline.total_seconds(),
        )

    def _event_from(self, event: object, headers: Mapping[str, str]) -> WebhookEvent:
        if not isinstance(event, dict) or not str_or_none(event.get("type")):
            raise WebhookMalformed("webhook body is not a sandbox event")
        event_type: str = event["type"]
        data = event.get("data")
        outcome = EVENT_KINDS.get(event_type)
        if outcome is not None and (not isinstance(data, dict) or not str_or_none(data.get("id"))):
            raise WebhookMalformed(f"{event_type} event without an effect")
        effect: Mapping[str, Any] = data if isinstance(data, dict) else {}
        metadata = effect.get("metadata")
        occurred_at = unix_time(event.get("created"))
        event_id = headers.get("webhook-id") or str_or_none(event.get("id"))
        if event_id is None:  # verify() requires webhook-id, so this is only defensive
            raise WebhookMalformed("webhook without an event id")
        return WebhookEvent(
            event_id=event_id,
            event_type=event_type,
            outcome=outcome,
            provider_reference=str_or_none(effect.get("id")),
            downstream_key=str_or_none(effect.get("idempotency_key")),
            # Effects made before keys came from the namespace carry payorch's operation id.
            operation_id=(
                str_or_none(metadata.get("operation_id")) if isinstance(metadata, dict) else None
            ),
            occurred_at=occurred_at,
            body=event,
            # The same code a status query stores for this decline.
            code=(
                (VOIDED if event_type == "effect.voided" else None)
                or str_or_none(effect.get("decline_code"))
                or "declined"
                if outcome is AnswerKind.DECLINED
                else None
            ),
            # A released authorisation: what became of the effect, whatever its outcome was.
            lifecycle=VOIDED if event_type == "effect.voided" else None,
        )


_CAPABILITIES = frozenset(
    {
        Capability.STATUS_BY_REFERENCE,
        Capability.STATUS_BY_KEY,
        Capability.REPLAY,
        Capability.VOID_BY_KEY,
        Capability.WEBHOOKS,
    }
)
