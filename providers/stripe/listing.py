"""Listing what payorch made at Stripe by creation range (``StripeProvider.list_effects``).

PaymentIntents (payment.create) and Refunds (refund.create) are listed with Stripe's list
API (``created[gte]``, ``created[lte]``, ``limit``, ``starting_after``, ``has_more``), a
bounded number of pages each, and only the objects carrying payorch's metadata are kept.
Each object is classified by the same functions as a status query (:mod:`.classify`), so a
listed effect reads as its status query would. No I/O here: ``send`` makes one call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from payorch.provider import (
    Answer,
    AnswerKind,
    ProviderEffect,
    bounded_object,
    listing_failed,
    listing_range,
    payorch_tags_of,
)

from .classify import PAYMENT_CREATE, REFUND_CREATE, Reply, failure_answer, object_answer
from .flows import Call
from .forms import STRIPE_ID

__all__ = ["MAX_LIST_PAGES", "list_effects"]

_PAGE = 100  # Stripe's largest page
MAX_LIST_PAGES = 50  # per kind of object; then the listing fails: narrow the window
# What a listed object was made by: the path that lists it and the operation it answers.
_LISTS = (("/v1/payment_intents", PAYMENT_CREATE), ("/v1/refunds", REFUND_CREATE))

Send = Callable[[Call], Reply | Answer]  # one call made: Stripe's reply, or why there is none


def list_effects(send: Send, since: datetime, until: datetime) -> Iterator[ProviderEffect]:
    """Every PaymentIntent and Refund created in ``[since, until]`` that carries payorch's
    tags, page by page as the caller iterates; ``ProviderListingFailed`` when a page cannot
    be read or the bound is hit."""
    start, end = listing_range(since, until)
    for path, operation in _LISTS:
        params = {"created[gte]": str(start), "created[lte]": str(end), "limit": str(_PAGE)}
        for _ in range(MAX_LIST_PAGES):
            items, more = _page(send(Call(method="GET", path=path, params=dict(params))))
            for item in items:
                effect = _effect(operation, item)
                if effect is not None:
                    yield effect
            last = items[-1].get("id") if items else None
            if not more or not isinstance(last, str):
                break
            params["starting_after"] = last
        else:
            raise listing_failed(
                "stripe",
                Answer(
                    kind=AnswerKind.AMBIGUOUS,
                    code="too_many_pages",
                    message=f"more than {MAX_LIST_PAGES * _PAGE} objects at {path}; "
                    "narrow the window",
                ),
            )


def _page(reply: Reply | Answer) -> tuple[list[dict[str, Any]], bool]:
    """The objects of one list page and whether more follow; ``ProviderListingFailed``."""
    if isinstance(reply, Answer):
        raise listing_failed("stripe", reply)
    failure = failure_answer(reply, query=True)
    if failure is not None:
        raise listing_failed("stripe", failure)
    data = reply.body.get("data") if reply.body is not None else None
    if reply.body is None or not isinstance(data, list):
        raise listing_failed(
            "stripe",
            Answer(
                kind=AnswerKind.AMBIGUOUS,
                status_code=reply.status,
                code="unexpected_body",
                message="a 2xx list reply without a data list",
            ),
        )
    return [item for item in data if isinstance(item, dict)], reply.body.get("has_more") is True


def _effect(operation: str, item: Mapping[str, Any]) -> ProviderEffect | None:
    """A listed object as an effect, or None if payorch did not make it (no tags);
    ``ProviderListingFailed`` for one of ours that cannot be read."""
    tags = payorch_tags_of(item.get("metadata"))
    if not tags:
        return None
    ident = item.get("id")
    created = item.get("created")
    created_at = None
    if isinstance(created, int) and not isinstance(created, bool):
        try:
            created_at = datetime.fromtimestamp(created, tz=UTC)
        except (OverflowError, OSError, ValueError):
            created_at = None
    if not isinstance(ident, str) or not STRIPE_ID.fullmatch(ident) or created_at is None:
        # Ours, yet unreadable: skipping it could hide the very effect looked for.
        raise listing_failed(
            "stripe",
            Answer(
                kind=AnswerKind.AMBIGUOUS,
                code="unexpected_body",
                message="a listed object with payorch's metadata but no valid id or created",
            ),
        )
    answer = object_answer(operation, item, query=True, status_code=200)
    amount = item.get("amount")
    currency = item.get("currency")
    return ProviderEffect(
        provider_reference=ident,
        # A status no outcome of the operation (e.g. a capture's) reads as AMBIGUOUS.
        kind=answer.kind if answer.kind is not AnswerKind.NOT_FOUND else AnswerKind.AMBIGUOUS,
        amount=amount if isinstance(amount, int) and not isinstance(amount, bool) else None,
        currency=currency if isinstance(currency, str) and currency else None,
        created_at=created_at,
        tags=tags,
        object_type=str(item.get("object") or operation),
        code=answer.code if answer.kind is AnswerKind.DECLINED else None,
        raw=bounded_object(item),
    )
