"""Listing what payorch made at Stripe by creation range (``StripeProvider.list_effects``).

PaymentIntents (payment.create) and Refunds (refund.create) are listed with Stripe's list
API (``created[gte]``, ``created[lte]``, ``limit``, ``starting_after``, ``has_more``), and
only the objects carrying payorch's metadata are kept. Each object is classified by the same
functions as a status query (:mod:`._classify`), so a listed effect reads as its status query
would. No I/O here: ``send`` makes one call.

The window is listed in slices, each at most ``MAX_LIST_PAGES`` pages: a slice that has
more is listed again as its two halves (whole seconds, as Stripe dates objects), at most
``MAX_LIST_SLICES`` slices per kind of object. An object listed in an overflowing slice and
again in its half is yielded once (by id), so nothing depends on the order Stripe lists in.
What still cannot be read (more objects than a slice holds within one second, or the slices
spent) is named at the end, after the rest of the window, of both kinds, was yielded:
``ProviderListingFailed`` (``too_many_pages``) with the sub-ranges left unread.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from ...provider import (
    Answer,
    AnswerKind,
    ProviderEffect,
    bounded_object,
    listing_failed,
    listing_range,
    payorch_tags_of,
    unix_time,
)
from ._classify import PAYMENT_CREATE, REFUND_CREATE, Reply, failure_answer, object_answer
from ._flows import Call
from ._forms import STRIPE_ID

__all__ = ["MAX_LIST_PAGES", "MAX_LIST_SLICES", "list_effects"]

_PAGE = 100  # Stripe's largest page
MAX_LIST_PAGES = 50  # per slice of the window; a slice with more is listed again in halves
MAX_LIST_SLICES = 32  # per kind of object: at most this many slices' pages are read
_UNREAD_SHOWN = 5  # sub-ranges named in the error, at most
# What a listed object was made by: the path that lists it and the operation it answers.
_LISTS = (("/v1/payment_intents", PAYMENT_CREATE), ("/v1/refunds", REFUND_CREATE))

Send = Callable[[Call], Reply | Answer]  # one call made: Stripe's reply, or why there is none
Unread = tuple[str, int, int]  # a path and the whole seconds [lo, hi] not listed there


def list_effects(send: Send, since: datetime, until: datetime) -> Iterator[ProviderEffect]:
    """Every PaymentIntent and Refund created in ``[since, until]`` that carries payorch's
    tags, page by page as the caller iterates; ``ProviderListingFailed`` when a page cannot
    be read, or (``too_many_pages``) at the end, naming what the bounds left unread."""
    start, end = listing_range(since, until)
    unread: list[Unread] = []
    for path, operation in _LISTS:
        yield from _list_kind(send, path, operation, (start, end), unread=unread)
    if unread:
        raise listing_failed(
            "stripe",
            Answer(kind=AnswerKind.AMBIGUOUS, code="too_many_pages", message=_unread(unread)),
        )


def _list_kind(
    send: Send, path: str, operation: str, span: tuple[int, int], *, unread: list[Unread]
) -> Iterator[ProviderEffect]:
    """One kind of object over ``span`` (whole seconds, both included), slice by slice;
    what the bounds leave unread is appended to ``unread``."""
    seen: set[str] = set()
    todo = [span]
    slices = 0
    while todo:
        lo, hi = todo.pop()
        if slices >= MAX_LIST_SLICES:
            unread.append((path, lo, hi))
            continue
        slices += 1
        whole = yield from _list_slice(send, path, operation, (lo, hi), seen=seen)
        if whole:
            continue
        if lo >= hi:  # one second holds more than a slice: it cannot be split
            unread.append((path, lo, hi))
            continue
        mid = (lo + hi) // 2
        todo.append((mid + 1, hi))
        todo.append((lo, mid))  # popped first: the older half, then the newer


def _list_slice(
    send: Send, path: str, operation: str, span: tuple[int, int], *, seen: set[str]
) -> Generator[ProviderEffect, None, bool]:
    """The objects created in ``span`` not yielded before (their ids are added to ``seen``);
    whether the slice was read to its end within ``MAX_LIST_PAGES`` pages."""
    lo, hi = span
    params = {"created[gte]": str(lo), "created[lte]": str(hi), "limit": str(_PAGE)}
    for _ in range(MAX_LIST_PAGES):
        items, more = _page(send(Call(method="GET", path=path, params=dict(params))))
        for item in items:
            effect = _effect(operation, item)
            if effect is not None and effect.provider_reference not in seen:
                seen.add(effect.provider_reference)
                yield effect
        last = items[-1].get("id") if items else None
        if not more or not isinstance(last, str):
            return True
        params["starting_after"] = last
    return False


def _unread(unread: list[Unread]) -> str:
    """The sub-ranges left unread, adjacent ones merged, for the error's message."""
    merged: list[list[Any]] = []
    for path, lo, hi in sorted(unread):
        if merged and merged[-1][0] == path and merged[-1][2] + 1 >= lo:
            merged[-1][2] = max(merged[-1][2], hi)
        else:
            merged.append([path, lo, hi])
    shown = "; ".join(
        f"{path} created {_when(lo)} to {_when(hi)}" for path, lo, hi in merged[:_UNREAD_SHOWN]
    )
    more = f" and {len(merged) - _UNREAD_SHOWN} more" if len(merged) > _UNREAD_SHOWN else ""
    return (
        f"left unread (more than {MAX_LIST_PAGES * _PAGE} objects within one second, or "
        f"more than {MAX_LIST_SLICES} slices of {MAX_LIST_PAGES} pages needed): "
        f"{shown}{more}; the rest of the window was listed; list these ranges again"
    )


def _when(second: int) -> str:
    return datetime.fromtimestamp(second, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    created_at = unix_time(created) if isinstance(created, int) else None
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
