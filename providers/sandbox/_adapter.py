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
from dataclasses import replace
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
    ProviderIdempotencyError,
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
    answer_from_http_status,
    answer_from_transport_error,
    asend_with_deadline,
    bounded_object,
    bounded_raw,
    call_budget,
    listing_failed,
    listing_range,
    parse_retry_after,
    payorch_tags_of,
    send_with_deadline,
    unix_time,
)

__all__ = ["DEFAULT_TIMEOUT", "SandboxProvider"]

DEFAULT_TIMEOUT = httpx.Timeout(connect=2.0, read=5.0, write=5.0, pool=2.0)
_LIST_PAGE = 100  # effects per page of list_effects (the sandbox's maximum)
MAX_LIST_PAGES = 100  # then list_effects gives up: a narrower window lists the rest

_EFFECT_KINDS = {
    "succeeded": AnswerKind.SUCCEEDED,
    "declined": AnswerKind.DECLINED,
    "processing": AnswerKind.PENDING,
    # Released before capture: no money moved (a void's outcome, code "voided").
    "voided": AnswerKind.DECLINED,
}
_EVENT_KINDS = {
    "effect.succeeded": AnswerKind.SUCCEEDED,
    "effect.declined": AnswerKind.DECLINED,
    "effect.processing": AnswerKind.PENDING,
    "effect.voided": AnswerKind.DECLINED,
}
VOIDED = "voided"  # the code and lifecycle of a voided authorisation
# When one key has several effects (it was reused past the window), money that moved wins.
_PRECEDENCE = {AnswerKind.SUCCEEDED: 0, AnswerKind.PENDING: 1, AnswerKind.DECLINED: 2}


def _json_object(content: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(content)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return parsed if isinstance(parsed, dict) else None


def _error_of(body: Mapping[str, Any] | None) -> Mapping[str, Any]:
    error = body.get("error") if body is not None else None
    return error if isinstance(error, Mapping) else {}


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


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
        self._base_url = base_url.rstrip("/")
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
        return _classify_void(response)

    async def avoid(self, request: VoidRequest) -> Answer:
        try:
            response = await self._asend(self._void_request(self._clients.asynchronous(), request))
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return _classify_void(response)

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
        return self._classify_submit(response, request)

    def wire_request(self, request: SubmitRequest) -> WireRequest:
        """What :meth:`submit` sends for ``request`` (a :class:`payorch.wire.Resender`)."""
        built = self._submit_request(self._clients.sync, request)
        return WireRequest.of(built, base_url=self._base_url)

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
        return self._classify_query(response, by_reference=bool(query.provider_reference))

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
                yield _listed_effect(self._name, item)
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
        status, body, evidence, shared = _read(response)
        if shared is not None:
            raise listing_failed(self._name, shared)
        data = body.get("data") if body is not None else None
        if status != 200 or not isinstance(data, list) or not isinstance(body, dict):
            code = _str_or_none(_error_of(body).get("code")) or f"http_{status}"
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
        return self._classify_submit(response, request)

    async def aquery_status(self, query: StatusQuery) -> Answer:
        client = self._clients.asynchronous()
        try:
            response = await self._asend(self._query_request(client, query))
        except httpx.HTTPError as exc:
            return answer_from_transport_error(exc)
        return self._classify_query(response, by_reference=bool(query.provider_reference))

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

    # -- classification --------------------------------------------------------------------

    def _classify_submit(self, response: httpx.Response, request: SubmitRequest) -> Answer:
        status, body, evidence, shared = _read(response)
        if shared is not None:
            return shared
        if 200 <= status < 300:
            return self._from_effect(body, evidence)
        error = _error_of(body)
        code = _str_or_none(error.get("code"))
        message = _str_or_none(error.get("message"))
        if status == 400 and code == "idempotency_key_reused":
            raise ProviderIdempotencyError(
                "the sandbox saw this downstream key with another request",
                operation_id=request.operation_id,
            )
        if status == 409 and code == "request_in_progress":
            # Our own earlier attempt is still executing there: this one did nothing.
            return Answer(
                kind=AnswerKind.NOT_SENT,
                retry_after=parse_retry_after(response.headers.get("retry-after")),
                code=code,
                message=message,
                **evidence,
            )
        if 400 <= status < 500 and _is_refusal(status, error):
            decline_code = _str_or_none(error.get("decline_code"))
            return Answer(
                kind=AnswerKind.DECLINED,
                provider_reference=_str_or_none(error.get("effect_id")),
                code=decline_code or code or f"http_{status}",
                message=message,
                **evidence,
            )
        # 1xx / 3xx, or a 4xx without the sandbox's error object (a proxy's page, a 408):
        # not an answer we understand, and possibly sent.
        return Answer(kind=AnswerKind.AMBIGUOUS, code=f"http_{status}", **evidence)

    def _classify_query(self, response: httpx.Response, *, by_reference: bool) -> Answer:
        status, body, evidence, shared = _read(response)
        if shared is not None:
            return shared
        if status == 404 and by_reference:
            return Answer(kind=AnswerKind.NOT_FOUND, code="resource_missing", **evidence)
        if status != 200 or body is None:
            # A read that failed oddly is not evidence of anything.
            return Answer(kind=AnswerKind.AMBIGUOUS, code=f"http_{status}", **evidence)
        if by_reference:
            return self._from_effect(body, evidence)
        return self._from_listing(body, evidence)

    def _from_listing(self, body: Mapping[str, Any], evidence: dict[str, Any]) -> Answer:
        data = body.get("data")
        if not isinstance(data, list):
            return Answer(kind=AnswerKind.AMBIGUOUS, code="unexpected_body", **evidence)
        if not data:
            return Answer(kind=AnswerKind.NOT_FOUND, **evidence)
        answers = [self._from_effect(e if isinstance(e, dict) else None, evidence) for e in data]
        best = min(answers, key=lambda a: _PRECEDENCE.get(a.kind, len(_PRECEDENCE)))
        if len(data) > 1:
            # The key was reused past the window: more than one effect. Say so in evidence,
            # and name the others so the reconciler can flag the duplicate.
            refs = dict.fromkeys(a.provider_reference for a in answers if a.provider_reference)
            others = tuple(r for r in refs if r != best.provider_reference)
            return replace(best, message=f"{len(data)} effects for this key", duplicates=others)
        return best

    @staticmethod
    def _from_effect(effect: Mapping[str, Any] | None, evidence: dict[str, Any]) -> Answer:
        """SUCCEEDED / DECLINED / PENDING from an effect; AMBIGUOUS if it is not one."""
        effect_id = _str_or_none(effect.get("id")) if effect is not None else None
        status = _str_or_none(effect.get("status")) if effect is not None else None
        if effect is None or effect_id is None or status is None:
            return Answer(kind=AnswerKind.AMBIGUOUS, code="unexpected_body", **evidence)
        kind = _EFFECT_KINDS.get(status, AnswerKind.AMBIGUOUS)
        code = None
        if kind is AnswerKind.DECLINED:
            code = _str_or_none(effect.get("decline_code")) or "declined"
        elif kind is AnswerKind.AMBIGUOUS:
            code = f"unexpected_status:{status}"[:64]
        return Answer(kind=kind, provider_reference=effect_id, code=code, **evidence)

    def _event_from(self, event: object, headers: Mapping[str, str]) -> WebhookEvent:
        if not isinstance(event, dict) or not _str_or_none(event.get("type")):
            raise WebhookMalformed("webhook body is not a sandbox event")
        event_type: str = event["type"]
        data = event.get("data")
        outcome = _EVENT_KINDS.get(event_type)
        if outcome is not None and (not isinstance(data, dict) or not _str_or_none(data.get("id"))):
            raise WebhookMalformed(f"{event_type} event without an effect")
        effect: Mapping[str, Any] = data if isinstance(data, dict) else {}
        metadata = effect.get("metadata")
        occurred_at = unix_time(event.get("created"))
        event_id = headers.get("webhook-id") or _str_or_none(event.get("id"))
        if event_id is None:  # verify() requires webhook-id, so this is only defensive
            raise WebhookMalformed("webhook without an event id")
        return WebhookEvent(
            event_id=event_id,
            event_type=event_type,
            outcome=outcome,
            provider_reference=_str_or_none(effect.get("id")),
            downstream_key=_str_or_none(effect.get("idempotency_key")),
            # Effects made before keys came from the namespace carry payorch's operation id.
            operation_id=(
                _str_or_none(metadata.get("operation_id")) if isinstance(metadata, dict) else None
            ),
            occurred_at=occurred_at,
            body=event,
            # The same code a status query stores for this decline.
            code=(
                (VOIDED if event_type == "effect.voided" else None)
                or _str_or_none(effect.get("decline_code"))
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


def _classify_void(response: httpx.Response) -> Answer:
    status, body, evidence, shared = _read(response)
    if shared is not None:
        return shared
    error = _error_of(body)
    code = _str_or_none(error.get("code"))
    if status == 409 and code == "request_in_progress":
        # The payment itself is being made right now: nothing was voided; send it again.
        retry = parse_retry_after(response.headers.get("retry-after"))
        return Answer(kind=AnswerKind.NOT_SENT, status_code=409, retry_after=retry, code=code)
    if status == 400 and code == "already_captured":
        effect = error.get("effect")
        ref = _str_or_none(effect.get("id")) if isinstance(effect, dict) else None
        return Answer(kind=AnswerKind.DECLINED, provider_reference=ref, code=code, **evidence)
    if status != 200 or not isinstance(body, dict):
        return Answer(kind=AnswerKind.AMBIGUOUS, code=f"http_{status}", **evidence)
    effect = body.get("effect")
    ref = _str_or_none(effect.get("id")) if isinstance(effect, dict) else None
    kind, code = _VOID_RESULTS.get(body.get("status"), (AnswerKind.AMBIGUOUS, "unexpected_body"))
    return Answer(kind=kind, provider_reference=ref, code=code, **evidence)


_VOID_RESULTS: Mapping[object, tuple[AnswerKind, str]] = {
    "voided": (AnswerKind.SUCCEEDED, VOIDED),
    # Nothing was made under the key, and the sandbox now refuses anything under it: void.
    "nothing_found": (AnswerKind.SUCCEEDED, "nothing_found"),
}


def _listed_effect(provider: str, item: object) -> ProviderEffect:
    """One listed ledger entry; ``ProviderListingFailed`` if it is not one."""
    entry: Mapping[str, Any] = item if isinstance(item, dict) else {}
    effect_id = _str_or_none(entry.get("id"))
    status = _str_or_none(entry.get("status"))
    amount = entry.get("amount")
    created = entry.get("created")
    created_at = unix_time(created) if isinstance(created, int) else None
    if effect_id is None or status is None or created_at is None:
        raise listing_failed(
            provider,
            Answer(
                kind=AnswerKind.AMBIGUOUS,
                code="unexpected_body",
                message="a listed effect without an id, a status or a creation time",
            ),
        )
    kind = _EFFECT_KINDS.get(status, AnswerKind.AMBIGUOUS)
    return ProviderEffect(
        provider_reference=effect_id,
        kind=kind,
        amount=amount if isinstance(amount, int) and not isinstance(amount, bool) else None,
        currency=_str_or_none(entry.get("currency")),
        created_at=created_at,
        tags=payorch_tags_of(entry.get("metadata")),
        object_type=_str_or_none(entry.get("object")) or "effect",
        downstream_key=_str_or_none(entry.get("idempotency_key")),
        code=(_str_or_none(entry.get("decline_code")) or "declined")
        if kind is AnswerKind.DECLINED
        else None,
        raw=bounded_object(entry),
    )


# The sandbox's own refusals, all decided before it commits anything.
_REFUSAL_TYPES = frozenset({"card_error", "invalid_request_error", "authentication_error"})


def _is_refusal(status: int, error: Mapping[str, Any]) -> bool:
    """A 4xx is final only when the acquirer itself says why; anything else may be a proxy."""
    return status != 408 and _str_or_none(error.get("type")) in _REFUSAL_TYPES


def _read(
    response: httpx.Response,
) -> tuple[int, dict[str, Any] | None, dict[str, Any], Answer | None]:
    """Status, parsed body and evidence of a response, and the shared 429/5xx answer if any."""
    status = response.status_code
    content = response.content
    body = _json_object(content)
    raw = None if body is not None else bounded_raw(content)
    evidence: dict[str, Any] = {"status_code": status, "body": body, "raw": raw}
    shared = answer_from_http_status(
        status, retry_after=response.headers.get("retry-after"), raw=content
    )
    return status, body, evidence, (replace(shared, body=body, raw=raw) if shared else None)
