"""What one Stripe ``submit`` or status query *does*, as a flow of HTTP calls, without I/O.

A flow is a generator (httpx's ``auth_flow`` design): it yields each :class:`Call` it needs,
receives that call's :class:`Reply` (or the :class:`Answer` a transport failure became), and
returns the final :class:`Answer`. The adapter runs it with a sync driver (``httpx.Client``)
or an async one (``httpx.AsyncClient``), so a multi-step query (search, then read each
object; page through refunds; list intents where Search is unavailable) is decided in one
place.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from ...errors import ConfigurationError
from ...provider import (
    TAG_LEGACY_OPERATION_ID,
    Answer,
    AnswerKind,
    StatusQuery,
    SubmitRequest,
    bounded_raw,
)
from ._classify import (
    PAYMENT_CAPTURE,
    PAYMENT_CREATE,
    REFUND_CREATE,
    Reply,
    failure_answer,
    object_answer,
    pick_answer,
)
from ._forms import (
    STRIPE_ID,
    InvalidPayload,
    own_tag,
    payment_intent_of,
    require_supported,
    search_query,
    submit_call,
)

__all__ = ["Call", "Flow", "query_flow", "submit_answer", "submit_flow"]

_SEARCH_LIMIT = 10  # objects retrieved after a search; more than one is already an anomaly
_REFUND_PAGES = 10  # pages of 100 refunds listed per payment intent before giving up
_INTENT_PAGES = 10  # pages of 100 PaymentIntents listed when Search is unavailable
# The listing runs from a little before the operation was created (our clock and the
# endpoint's may differ) to as late as an attempt can have been sent: inline retries under
# the executor's lease, then re-submissions while the idempotency window lasts.
_CLOCK_SLACK = timedelta(minutes=10)
_LATE_SEND = timedelta(hours=1)
_SEARCH_OFF = ("not enabled", "not available", "unavailable", "not supported")


@dataclass(frozen=True, kw_only=True)
class Call:
    """One HTTP call a flow asks its driver to make."""

    method: str
    path: str
    params: Mapping[str, str] | None = None
    form: Mapping[str, str] | None = None
    idempotency_key: str | None = None


Flow = Generator[Call, Reply | Answer, Answer]


def submit_flow(request: SubmitRequest) -> Flow:
    """Send ``request`` once with its downstream key and classify Stripe's answer.

    Raises ConfigurationError for an operation the adapter does not support and
    ProviderIdempotencyError when Stripe says the key was used with other parameters.
    """
    require_supported(request.operation)
    try:
        path, form = submit_call(request)
    except InvalidPayload as exc:
        # Nothing was sent; Stripe would have refused it with a 400 all the same.
        return Answer(kind=AnswerKind.DECLINED, code="invalid_payload", message=str(exc))
    reply = yield Call(method="POST", path=path, form=form, idempotency_key=request.downstream_key)
    return submit_answer(request, reply)


def submit_answer(request: SubmitRequest, reply: Reply | Answer) -> Answer:
    """What Stripe's ``reply`` to the submission of ``request`` says (a transport failure's
    answer as it is); raises ProviderIdempotencyError as :func:`submit_flow` says."""
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


def query_flow(query: StatusQuery, *, window: timedelta | None = None) -> Flow:
    """Where ``query``'s operation stands at Stripe (see ``StripeProvider.query_status``).

    ``window``: how long the endpoint honours our key (None: not at all), which bounds how
    late a PaymentIntent can have been created for the operation.
    """
    require_supported(query.operation)
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
        return (yield from _retrieve(query, path))
    if query.operation == PAYMENT_CREATE:
        return (yield from _search_intents(query, window))
    intent = _payload_intent(query)
    if query.operation == PAYMENT_CAPTURE:
        return (yield from _retrieve(query, f"/v1/payment_intents/{intent}"))
    return (yield from _list_refunds(query, intent))


def _retrieve(query: StatusQuery, path: str) -> Flow:
    reply = yield Call(method="GET", path=path)
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
        tag=own_tag(query.tags),
        reply=reply,
    )


def _payload_intent(query: StatusQuery) -> str:
    try:
        return payment_intent_of(query.payload)
    except InvalidPayload as exc:
        raise ConfigurationError(
            f"status query of {query.operation} without a provider reference needs "
            f"the operation's payload: {exc}",
            operation_id=query.operation_id,
        ) from exc


_Page = tuple[Reply, dict[str, Any], list[dict[str, Any]]]


def _list_page(
    path: str, params: Mapping[str, str]
) -> Generator[Call, Reply | Answer, _Page | Answer]:
    """One list or search page: the reply, its body and its objects, or the final answer."""
    reply = yield Call(method="GET", path=path, params=dict(params))
    return _page(reply)


def _page(reply: Reply | Answer) -> _Page | Answer:
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


def _search_intents(query: StatusQuery, window: timedelta | None) -> Flow:
    params = {"query": search_query(own_tag(query.tags))}
    reply = yield Call(method="GET", path="/v1/payment_intents/search", params=params)
    if _search_unavailable(reply):
        # A Stripe-compatible endpoint without Search: asking again would fail the same
        # way until max_checks. The plain list is consistent, so it settles at once.
        return (yield from _list_intents(query, window))
    page = _page(reply)
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
    answers = []
    for pi in ids[:_SEARCH_LIMIT]:
        answers.append((yield from _retrieve(query, f"/v1/payment_intents/{pi}")))
    return _picked(answers, ids)


def _search_unavailable(reply: Reply | Answer) -> bool:
    """Whether a search reply says the endpoint has no Search (not that nothing matched)."""
    if isinstance(reply, Answer):
        return False
    if reply.status == 404:  # the search route itself is missing
        return True
    err = reply.error
    message = err.get("message") if err is not None else None
    if reply.status != 400 or not isinstance(message, str):
        return False
    text = message.lower()
    return "search" in text and any(phrase in text for phrase in _SEARCH_OFF)


def _created_range(query: StatusQuery, window: timedelta | None) -> tuple[float, float] | None:
    """When a PaymentIntent for the operation can have been created (Unix seconds, loosely).

    An operation of the earlier form tells its claim time by its UUIDv7 id. One whose key
    comes from the namespace may have been claimed again after a failover lost its first
    claim, so its stored creation time is only the latest the key can have been first used:
    reach back by the window in which Stripe would have answered that first use.
    """
    slack = _CLOCK_SLACK.total_seconds()
    late = (_LATE_SEND + (window or timedelta(0))).total_seconds() + slack
    if TAG_LEGACY_OPERATION_ID in query.tags:
        try:
            ident = uuid.UUID(query.operation_id)
        except ValueError:
            return None
        if ident.version != 7:
            return None
        claimed = (ident.int >> 80) / 1000
        return claimed - slack, claimed + late
    if query.created_at is None:
        return None
    claimed = query.created_at.timestamp()
    return claimed - (window or timedelta(0)).total_seconds() - slack, claimed + late


def _tagged(tag: tuple[str, str]) -> Callable[[Mapping[str, Any]], bool]:
    name, value = tag

    def match(item: Mapping[str, Any]) -> bool:
        metadata = item.get("metadata")
        return isinstance(metadata, dict) and metadata.get(name) == value

    return match


_Scan = tuple[list[Answer], Reply, dict[str, Any], bool]


def _scan(
    query: StatusQuery,
    path: str,
    params: dict[str, str],
    operation: str,
    pages: int,
) -> Generator[Call, Reply | Answer, _Scan | Answer]:
    """Page through a list (at most ``pages``), classifying each object tagged with the
    operation: (answers, last reply, last body, whether the list was read to its end)."""
    tag = own_tag(query.tags)
    match = _tagged(tag)
    found: list[Answer] = []
    for _ in range(pages):
        page = yield from _list_page(path, params)
        if isinstance(page, Answer):
            return page
        reply, body, data = page
        found.extend(
            object_answer(
                operation,
                item,
                query=True,
                status_code=reply.status,
                tag=tag,
            )
            for item in data
            if match(item)
        )
        last = data[-1].get("id") if data else None
        if body.get("has_more") is not True or not isinstance(last, str):
            return found, reply, body, True
        params["starting_after"] = last
    return found, reply, body, False


def _list_intents(query: StatusQuery, window: timedelta | None) -> Flow:
    created = _created_range(query, window)
    if created is None:
        return Answer(
            kind=AnswerKind.AMBIGUOUS,
            code="search_unavailable",
            message="Search is unavailable and the operation tells no creation time",
        )
    start, end = math.floor(created[0]), math.ceil(created[1])
    params = {"created[gte]": str(start), "created[lte]": str(end), "limit": "100"}
    scan = yield from _scan(query, "/v1/payment_intents", params, PAYMENT_CREATE, _INTENT_PAGES)
    if isinstance(scan, Answer):
        return scan
    found, reply, body, complete = scan
    if found:
        return _picked(found)
    if complete:
        return Answer(
            kind=AnswerKind.NOT_FOUND,
            status_code=reply.status,
            message=(
                f"Search is unavailable; no PaymentIntent created between {start} and {end} "
                "carries this operation's tag"
            ),
            body=body,
        )
    return Answer(
        kind=AnswerKind.AMBIGUOUS,
        code="too_many_intents",
        message=(
            f"Search is unavailable and more than {_INTENT_PAGES * 100} PaymentIntents were "
            f"created between {start} and {end}; stopped listing"
        ),
    )


def _list_refunds(query: StatusQuery, intent: str) -> Flow:
    params = {"payment_intent": intent, "limit": "100"}
    scan = yield from _scan(query, "/v1/refunds", params, REFUND_CREATE, _REFUND_PAGES)
    if isinstance(scan, Answer):
        return scan
    found, reply, body, complete = scan
    if found:
        return _picked(found)
    if complete:
        return Answer(
            kind=AnswerKind.NOT_FOUND,
            status_code=reply.status,
            message=f"no refund of {intent} carries this operation's tag",
            body=body,
        )
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
