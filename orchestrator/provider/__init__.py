"""The provider contract: what an adapter in ``providers/`` implements.

An adapter submits an operation with our downstream idempotency key, queries its status,
and parses signed webhooks. Every answer is classified into one :class:`Answer` kind, so the
executor and the reconciler never look at HTTP details. httpx errors are mapped once, here,
by :func:`answer_from_transport_error` and :func:`answer_from_http_status`. Every HTTP
call goes through :func:`send_with_deadline`, which bounds the whole call (httpx's own
time-outs are per socket operation, so a trickled answer could otherwise last for ever).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

import httpx

from ..clients import (
    RAW_EVIDENCE_LIMIT,
    DeadlineExceeded,
    asend_with_deadline,
    bounded_raw,
    call_budget,
    parse_retry_after,
    send_with_deadline,
    unix_time,
)
from ..core import downstream_key as derive_downstream_key
from ..core import is_namespace_key
from ..errors import WebhookMalformed, WebhookRejected
from ._answers import Answer, AnswerKind
from ._effects import (
    TAG_FINGERPRINT,
    TAG_KEY,
    TAG_LEGACY_OPERATION_ID,
    TAG_OPERATION,
    TAG_REF,
    TAG_TENANT,
    EffectLister,
    ProviderEffect,
    bounded_object,
    listing_failed,
    listing_range,
    payorch_tags_of,
)
from ._wire import DECIDING_HEADERS, WireRequest

__all__ = [
    "DECIDING_HEADERS",
    "DEFAULT_CAPABILITIES",
    "RAW_EVIDENCE_LIMIT",
    "STATUS_CAPABILITIES",
    "TAG_FINGERPRINT",
    "TAG_KEY",
    "TAG_LEGACY_OPERATION_ID",
    "TAG_OPERATION",
    "TAG_REF",
    "TAG_TENANT",
    "VOID_CAPABILITIES",
    "Answer",
    "AnswerKind",
    "AsyncProvider",
    "AsyncVoider",
    "BatchWebhooks",
    "Capability",
    "DeadlineExceeded",
    "EffectLister",
    "Provider",
    "ProviderEffect",
    "Resender",
    "StatusQuery",
    "SubmitRequest",
    "VoidRequest",
    "Voider",
    "WebhookBatch",
    "WebhookEvent",
    "WebhookItem",
    "WireRequest",
    "answer_from_http_status",
    "answer_from_transport_error",
    "asend_with_deadline",
    "bounded_object",
    "bounded_raw",
    "call_budget",
    "can_query_status",
    "can_void",
    "capabilities_of",
    "listing_failed",
    "listing_range",
    "parse_deliveries",
    "parse_retry_after",
    "payorch_tags_of",
    "provider_tags",
    "send_with_deadline",
    "unix_time",
]


def provider_tags(
    *,
    tenant_id: str,
    operation: str,
    idempotency_key: str,
    operation_id: str,
    downstream_key: str,
    fingerprint: str = "",
) -> dict[str, str]:
    """What payorch adds to a provider request's metadata, from the namespace alone.

    Adapters send these (and nothing else of payorch's) so that an effect can be found and
    explained by its namespace: a status query searches by ``payorch_ref``, and an effect no
    stored operation explains can be adopted under ``(tenant, operation, key)``. An operation
    whose downstream key is of the earlier, id-derived form keeps its earlier tags. The
    fingerprint is the request's own (the same fields give the same one, and other fields
    would be another request under the key, which the provider refuses).
    """
    if not is_namespace_key(downstream_key):
        return {TAG_LEGACY_OPERATION_ID: operation_id, TAG_TENANT: tenant_id}
    tags = {
        TAG_REF: downstream_key.split(":")[1],
        TAG_TENANT: tenant_id,
        TAG_OPERATION: operation,
        TAG_KEY: idempotency_key,
    }
    if fingerprint:
        tags[TAG_FINGERPRINT] = fingerprint
    return tags


@dataclass(frozen=True, kw_only=True)
class SubmitRequest:
    tenant_id: str
    operation: str  # e.g. "payment.create"
    # payorch's own id: for logs and traces. Never sent for an operation whose key comes
    # from the namespace (a failover may re-create it); the earlier form's tags carry it.
    operation_id: str
    downstream_key: str  # sent as the provider's idempotency key, identical on every attempt
    payload: Mapping[str, Any]  # the validated request, sensitive fields included
    idempotency_key: str = ""  # the client's key: the namespace's third part
    fingerprint: str = ""  # of the effect fields, as the claim stored it
    # The request as first sent (a WireRequest), which a Resender sends as it is.
    wire: WireRequest | None = None

    @property
    def tags(self) -> dict[str, str]:
        """The metadata to send with it (:func:`provider_tags`)."""
        return _tags_of(self)


@dataclass(frozen=True, kw_only=True)
class StatusQuery:
    tenant_id: str
    operation: str
    operation_id: str  # see SubmitRequest
    downstream_key: str
    provider_reference: str | None
    payload: Mapping[str, Any] = field(default_factory=dict)
    idempotency_key: str = ""
    fingerprint: str = ""
    # When this claim was made (the database clock). After a failover that lost the first
    # claim, the key was first used earlier than this: never search from it as a lower bound.
    created_at: datetime | None = None

    @property
    def tags(self) -> dict[str, str]:
        """The metadata its operation was submitted with (:func:`provider_tags`)."""
        return _tags_of(self)


def _tags_of(call: SubmitRequest | StatusQuery) -> dict[str, str]:
    return provider_tags(
        tenant_id=call.tenant_id,
        operation=call.operation,
        idempotency_key=call.idempotency_key,
        operation_id=call.operation_id,
        downstream_key=call.downstream_key,
        fingerprint=call.fingerprint,
    )


@dataclass(frozen=True, kw_only=True)
class WebhookEvent:
    """A verified provider event, reduced to what can move an operation."""

    event_id: str
    event_type: str
    outcome: AnswerKind | None  # SUCCEEDED / DECLINED / PENDING, or None if irrelevant
    provider_reference: str | None = None
    downstream_key: str | None = None
    operation_id: str | None = None
    occurred_at: datetime | None = None
    body: Mapping[str, Any] = field(default_factory=dict)
    # A DECLINED outcome's code, as the adapter's status query would report it for the same
    # object, so a decline reads the same whichever evidence settled it.
    code: str | None = None
    # What happened to the effect after its operation's outcome (e.g. "authorization_released"
    # for a released manual-capture authorisation): kept as evidence, never a contradiction.
    # "void_refused": the provider refused a void (evidence for the operation being voided).
    lifecycle: str | None = None
    operation: str | None = None  # the operation type it reports on; None: whichever it finds


class Capability(enum.StrEnum):
    """What an adapter can do to learn or settle an outcome (its ``capabilities``); the
    reconciler takes the strongest safe path they allow (docs/providers.md)."""

    STATUS_BY_REFERENCE = "status_by_reference"  # read an effect by the provider's own id
    STATUS_BY_KEY = "status_by_key"  # find an effect by our downstream key or metadata
    # Sending the identical request again under the same key answers the first outcome
    # (no second effect): within the window, a replay is a status query.
    REPLAY = "replay"
    VOID_BY_KEY = "void_by_key"  # cancel an uncaptured authorisation by our key/reference
    VOID_BY_REFERENCE = "void_by_reference"  # cancel one by the provider's reference
    WEBHOOKS = "webhooks"  # signed events report outcomes


STATUS_CAPABILITIES = frozenset({Capability.STATUS_BY_REFERENCE, Capability.STATUS_BY_KEY})
VOID_CAPABILITIES = frozenset({Capability.VOID_BY_KEY, Capability.VOID_BY_REFERENCE})
DEFAULT_CAPABILITIES = STATUS_CAPABILITIES | {Capability.WEBHOOKS}  # when none is declared


def capabilities_of(adapter: object) -> frozenset[Capability]:
    """The adapter's declared ``capabilities``, or :data:`DEFAULT_CAPABILITIES` if it
    declares none (an adapter written before they existed answers status queries)."""
    declared = getattr(adapter, "capabilities", None)
    return DEFAULT_CAPABILITIES if declared is None else frozenset(map(Capability, declared))


def can_query_status(adapter: object) -> bool:
    """Whether the adapter can be asked for an operation's status at all."""
    return bool(capabilities_of(adapter) & STATUS_CAPABILITIES)


def can_void(adapter: object, provider_reference: str | None) -> bool:
    """Whether the adapter can void an operation known by ``provider_reference`` (or None)."""
    caps = capabilities_of(adapter)
    by_ref = Capability.VOID_BY_REFERENCE in caps and bool(provider_reference)
    return isinstance(adapter, Voider) and (Capability.VOID_BY_KEY in caps or by_ref)


@runtime_checkable
class Provider(Protocol):
    """What payorch needs from a payment provider adapter.

    Optional beside these: ``capabilities`` (a set of :class:`Capability`; default
    :data:`DEFAULT_CAPABILITIES`), ``void`` (:class:`Voider`), ``parse_webhooks``
    (:class:`BatchWebhooks`) and ``list_effects`` (:class:`EffectLister`). An adapter that
    declares no status capability is never asked ``query_status`` by the reconciler; its
    ``query_status`` answers AMBIGUOUS with code ``status_unsupported``.
    """

    @property
    def name(self) -> str: ...

    @property
    def idempotency_window(self) -> timedelta | None:
        """How long the provider honours our idempotency key; None: it does not."""
        ...

    @property
    def max_call_duration(self) -> timedelta:
        """Upper bound of one ``submit`` or ``query_status`` call (lease sizing)."""
        ...

    def submit(self, request: SubmitRequest) -> Answer: ...

    def query_status(self, query: StatusQuery) -> Answer: ...

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent:
        """Verify the signature and parse; raise WebhookRejected subclasses on bad input."""
        ...


@runtime_checkable
class Resender(Protocol):
    """Optional, beside :class:`~payorch.provider.Provider`: an adapter that says what it
    would send for a submission, and sends exactly that when asked to.

    ``wire_request`` builds without sending; it raises or answers (NOT_SENT / DECLINED) as
    ``submit`` would for a request it refuses. ``submit`` (and ``asubmit``) of a request
    whose ``wire`` is set sends that wire request as it is, under the adapter's own
    credentials, and classifies the answer as for that request; without one, it sends what
    ``wire_request`` says.
    """

    def wire_request(self, request: SubmitRequest) -> WireRequest | Answer: ...


@runtime_checkable
class AsyncProvider(Protocol):
    """The async API's view of an adapter: :class:`Provider`'s calls as coroutines.

    The adapters in ``providers/`` implement both, sharing how a request is built and how an
    answer is classified; only the sending differs (``httpx.AsyncClient``). Webhook parsing
    does no I/O and stays synchronous.
    """

    @property
    def name(self) -> str: ...

    @property
    def idempotency_window(self) -> timedelta | None: ...

    @property
    def max_call_duration(self) -> timedelta: ...

    async def asubmit(self, request: SubmitRequest) -> Answer: ...

    async def aquery_status(self, query: StatusQuery) -> Answer: ...

    def parse_webhook(self, headers: Mapping[str, str], body: bytes) -> WebhookEvent: ...


@dataclass(frozen=True, kw_only=True)
class VoidRequest(StatusQuery):
    """Cancel the uncaptured authorisation an operation may have made (:class:`Voider`);
    ``void_key``, the void's own idempotency key, is a pure function of the operation's."""

    reason: str = ""
    actor: str = ""

    @property
    def void_key(self) -> str:
        if is_namespace_key(self.downstream_key):
            return derive_downstream_key(self.downstream_key.split(":")[1], "void")
        return f"{self.downstream_key}:void"


@runtime_checkable
class Voider(Protocol):
    """Optional, beside :class:`Provider`: an adapter that can void an authorisation.

    ``void`` answers, as evidence about the operation being voided:

    - SUCCEEDED: it is void now (nothing is held, and the key can no longer charge);
    - PENDING: the provider took the void; its outcome arrives later (a webhook);
    - NOT_FOUND: nothing found under the operation's key, which stays usable (not final);
    - DECLINED: it cannot be voided (e.g. captured already), ``code`` says why;
    - AMBIGUOUS / NOT_SENT: as for a submission; sending the same void again is safe.
    """

    def void(self, request: VoidRequest) -> Answer: ...


@runtime_checkable
class AsyncVoider(Protocol):
    """:class:`Voider` as a coroutine, for the async API."""

    async def avoid(self, request: VoidRequest) -> Answer: ...


@dataclass(frozen=True, kw_only=True)
class WebhookItem:
    """One event of a delivery (at ``index``): its verified event, or why it was refused."""

    index: int
    event: WebhookEvent | None = None
    rejected: WebhookRejected | None = None

    def __post_init__(self) -> None:
        if (self.event is None) == (self.rejected is None):
            raise ValueError("a webhook item is either an event or a rejection")


@dataclass(frozen=True, kw_only=True)
class WebhookBatch:
    """What one delivery carried, each item verified on its own. ``acknowledgement``: the
    body the provider expects once every item was taken (``[accepted]``), or None (JSON)."""

    items: tuple[WebhookItem, ...]
    acknowledgement: str | None = None


@runtime_checkable
class BatchWebhooks(Protocol):
    """Optional: an adapter whose deliveries may carry several events (``parse_webhooks``).

    It raises :class:`~payorch.errors.WebhookRejected` only for a delivery it cannot read at
    all; an item that fails its own signature is a rejected :class:`WebhookItem`.
    """

    def parse_webhooks(self, headers: Mapping[str, str], body: bytes) -> WebhookBatch: ...


def parse_deliveries(
    adapter: Provider | AsyncProvider, headers: Mapping[str, str], body: bytes
) -> WebhookBatch:
    """A delivery as a batch: ``parse_webhooks`` where the adapter has it, else the one
    event ``parse_webhook`` verifies (whose rejection rejects the delivery)."""
    batch = adapter.parse_webhooks(headers, body) if isinstance(adapter, BatchWebhooks) else None
    if batch is not None and not batch.items:
        raise WebhookMalformed("the delivery carries no event")
    return batch or WebhookBatch(
        items=(WebhookItem(index=0, event=adapter.parse_webhook(headers, body)),)
    )


# Errors raised before a byte of the request could reach the provider.
_NOT_SENT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.UnsupportedProtocol,
    httpx.LocalProtocolError,
)


def answer_from_transport_error(exc: httpx.HTTPError) -> Answer:
    """Map an httpx exception to NOT_SENT or AMBIGUOUS, the one place that decides it.

    Connect errors and pool time-outs happen before the request is written. Write/read
    time-outs, resets and protocol errors after connecting may follow a committed effect.
    A :class:`DeadlineExceeded` says itself whether writing had begun.
    """
    if isinstance(exc, DeadlineExceeded):
        kind = AnswerKind.AMBIGUOUS if exc.possibly_sent else AnswerKind.NOT_SENT
        return Answer(kind=kind, code=DeadlineExceeded.code, message=str(exc))
    kind = AnswerKind.NOT_SENT if isinstance(exc, _NOT_SENT_ERRORS) else AnswerKind.AMBIGUOUS
    return Answer(kind=kind, code=type(exc).__name__, message=str(exc) or type(exc).__name__)


def answer_from_http_status(
    status: int, *, retry_after: str | None = None, raw: str | bytes | None = None
) -> Answer | None:
    """Classify the statuses every provider shares; None means "adapter decides".

    401/403: the provider refused our credentials before doing anything. A configuration
    fault, not a verdict on the payment: NOT_SENT (never a replayable decline), code
    ``provider_auth_failed``. Its ``retry_after`` (60 s) says what is true, that backoff will
    not fix credentials; it also ends the executor's inline retries at once (they stop at a
    Retry-After above the policy's ``max_delay``).
    """
    if status in (401, 403):
        return Answer(
            kind=AnswerKind.NOT_SENT,
            status_code=status,
            retry_after=60.0,
            code="provider_auth_failed",
            message=(
                f"the provider refused our credentials (HTTP {status}): nothing was sent; "
                "fix the provider configuration"
            ),
            raw=bounded_raw(raw),
        )
    if status == 429:
        return Answer(
            kind=AnswerKind.NOT_SENT,
            status_code=status,
            retry_after=parse_retry_after(retry_after),
            code="rate_limited",
            raw=bounded_raw(raw),
        )
    if status >= 500:
        # 5xx and gateway errors may follow a commit: never treat them as "not done".
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            status_code=status,
            code=f"http_{status}",
            raw=bounded_raw(raw),
        )
    return None
