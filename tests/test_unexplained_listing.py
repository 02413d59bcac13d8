"""How the sandbox and Stripe (respx) adapters list their effects for the unexplained look."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import respx
from conftest import FAST_TIMEOUT
from unexplained_helpers import TENANT, post_untagged, window

from payorch.core import State, downstream_key, namespace_ref
from payorch.errors import ListingUnsupported, ProviderListingFailed
from payorch.operations import default_registry
from payorch.provider import AnswerKind
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.stripe import StripeProvider
from payorch.providers.stripe import _listing as stripe_listing
from payorch.reconciling._unexplained import scan
from payorch.storage._store import Store

# The installation's key scope is the environment's: none unless a test sets one.
pytestmark = pytest.mark.usefixtures("no_key_scope")


# -- the sandbox's listing -----------------------------------------------------------------


def test_the_sandbox_lists_by_creation_range_page_by_page(
    sandbox: SandboxServer, sandbox_provider: SandboxProvider
) -> None:
    made = [post_untagged(sandbox) for _ in range(205)]
    sandbox.advance(timedelta(hours=2))
    later = post_untagged(sandbox)

    listed = [e.provider_reference for e in sandbox_provider.list_effects(**window())]

    assert listed == made  # commit order, three pages, not the effect dated two hours on
    pages = [r for r in sandbox.requests() if r["path"].startswith("/v1/effects?")]
    assert len(pages) == 3
    assert "starting_after" in pages[1]["path"] and made[99] in pages[1]["path"]
    assert later not in listed


def test_a_listing_that_cannot_be_read_is_a_typed_error() -> None:
    def answer_503(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"type": "api_error"}})

    down = SandboxProvider(
        base_url="http://127.0.0.1:9",
        transport=httpx.MockTransport(answer_503),
        timeout=FAST_TIMEOUT,
    )
    with pytest.raises(ProviderListingFailed) as failed:
        list(down.list_effects(**window()))
    assert failed.value.code == "http_503"
    closed = SandboxProvider(base_url="http://127.0.0.1:9", timeout=FAST_TIMEOUT)
    with pytest.raises(ProviderListingFailed) as refused:
        list(closed.list_effects(**window()))
    assert refused.value.code == "ConnectError"
    assert "try again" in refused.value.message


def test_an_adapter_that_cannot_list_is_refused(store: Store) -> None:
    class SubmitsOnly:
        name = "acquirer"

    with pytest.raises(ListingUnsupported, match="'acquirer' cannot list"):
        scan(store, SubmitsOnly(), **window())


# -- Stripe's listing (respx) --------------------------------------------------------------

CREATED = int(datetime(2024, 5, 1, 12, tzinfo=UTC).timestamp())


def intent(ident: str, status: str = "succeeded", **metadata: str) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "payment_intent",
        "amount": 4200,
        "currency": "eur",
        "status": status,
        "capture_method": "automatic",
        "created": CREATED,
        "client_secret": f"{ident}_secret_x",
        "metadata": metadata,
        "last_payment_error": {"decline_code": "insufficient_funds"}
        if status == "requires_payment_method"
        else None,
    }


def page(*items: dict[str, Any], has_more: bool = False) -> httpx.Response:
    return httpx.Response(200, json={"object": "list", "data": list(items), "has_more": has_more})


OURS = {
    "payorch_ref": namespace_ref(TENANT, "payment.create", "k-s"),
    "payorch_tenant_id": TENANT,
    "payorch_operation": "payment.create",
    "payorch_idempotency_key": "k-s",
    "payorch_fingerprint": "cd" * 32,
}


def test_stripe_lists_payment_intents_by_creation_page_by_page(
    stripe: StripeProvider, router: respx.Router
) -> None:
    intents = router.get("/v1/payment_intents").mock(
        side_effect=[
            page(intent("pi_1", **OURS), intent("pi_2", order="42"), has_more=True),
            page(intent("pi_3", "requires_payment_method", **OURS)),
        ]
    )
    refunds = router.get("/v1/refunds").mock(return_value=page())
    since = datetime(2024, 5, 1, tzinfo=UTC)

    listed = list(stripe.list_effects(since, since + timedelta(days=1)))

    assert [(e.provider_reference, e.kind) for e in listed] == [
        ("pi_1", AnswerKind.SUCCEEDED),
        ("pi_3", AnswerKind.DECLINED),
    ]  # pi_2 carries no payorch tags: not ours
    assert listed[1].code == "insufficient_funds"
    assert dict(listed[0].tags) == OURS
    assert (listed[0].amount, listed[0].currency) == (4200, "eur")
    assert "client_secret" not in listed[0].raw
    first, second = (c.request.url.params for c in intents.calls)
    assert (first["created[gte]"], first["limit"]) == (str(int(since.timestamp())), "100")
    assert "starting_after" not in first and second["starting_after"] == "pi_2"
    assert refunds.call_count == 1


def test_stripe_listing_failures_are_typed_and_bounded(
    stripe: StripeProvider, router: respx.Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    router.get("/v1/payment_intents").mock(return_value=httpx.Response(500, json={}))
    with pytest.raises(ProviderListingFailed) as failed:
        list(stripe.list_effects(**window()))
    assert failed.value.code == "http_500"

    monkeypatch.setattr(stripe_listing, "MAX_LIST_PAGES", 2)
    router.get("/v1/payment_intents").mock(return_value=page(intent("pi_9"), has_more=True))
    router.get("/v1/refunds").mock(return_value=page())
    with pytest.raises(ProviderListingFailed) as bounded:
        list(stripe.list_effects(**window()))
    assert bounded.value.code == "too_many_pages"
    assert "/v1/payment_intents created" in bounded.value.message  # what was left unread


def stripe_lists(objects: list[dict[str, Any]]) -> Any:
    """Stripe's list endpoint over ``objects``: the created range, newest first, pages of
    ``limit`` after ``starting_after``, and ``has_more``."""

    def handler(request: httpx.Request) -> httpx.Response:
        params = request.url.params
        lo, hi = int(params["created[gte]"]), int(params["created[lte]"])
        chosen = sorted(
            (o for o in objects if lo <= o["created"] <= hi),
            key=lambda o: (-o["created"], o["id"]),
        )
        after = params.get("starting_after")
        if after is not None:
            chosen = chosen[[o["id"] for o in chosen].index(after) + 1 :]
        limit = int(params["limit"])
        return page(*chosen[:limit], has_more=len(chosen) > limit)

    return handler


def test_stripe_lists_a_busy_window_in_slices(
    stripe: StripeProvider, router: respx.Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stripe_listing, "MAX_LIST_PAGES", 2)  # 200 objects a slice
    day = datetime(2024, 5, 1, tzinfo=UTC)
    start = int(day.timestamp())
    made = [{**intent(f"pi_{i}", **OURS), "created": start + (i * 37) % 86400} for i in range(900)]
    made.append(intent("pi_theirs", order="7") | {"created": start + 5})
    intents = router.get("/v1/payment_intents").mock(side_effect=stripe_lists(made))
    router.get("/v1/refunds").mock(side_effect=stripe_lists([]))

    listed = [e.provider_reference for e in stripe.list_effects(day, day + timedelta(days=1))]

    assert sorted(listed) == sorted(f"pi_{i}" for i in range(900))  # each once, all of them
    ranges = {
        (c.request.url.params["created[gte]"], c.request.url.params["created[lte]"])
        for c in intents.calls
    }
    assert len(ranges) > 1  # the window was split
    assert intents.call_count <= stripe_listing.MAX_LIST_SLICES * 2


def test_stripe_names_what_one_busy_second_left_unread_and_lists_the_rest(
    stripe: StripeProvider, router: respx.Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stripe_listing, "MAX_LIST_PAGES", 2)
    day = datetime(2024, 5, 1, tzinfo=UTC)
    busy = int(day.timestamp()) + 3600
    crowded = [{**intent(f"pi_c{i}", **OURS), "created": busy} for i in range(250)]
    spread = [{**intent(f"pi_s{i}", **OURS), "created": busy - 1000 + i * 7} for i in range(50)]
    router.get("/v1/payment_intents").mock(side_effect=stripe_lists(crowded + spread))
    refund = {**intent("re_1", **OURS), "object": "refund", "status": "succeeded"}
    router.get("/v1/refunds").mock(side_effect=stripe_lists([{**refund, "created": busy}]))

    listed: list[str] = []
    with pytest.raises(ProviderListingFailed) as failed:
        for listed_effect in stripe.list_effects(day, day + timedelta(days=1)):
            listed.append(listed_effect.provider_reference)

    assert failed.value.code == "too_many_pages"
    assert "/v1/payment_intents created 2024-05-01T01:00:00Z to 2024-05-01T01:00:00Z" in (
        failed.value.message
    )
    assert {f"pi_s{i}" for i in range(50)} <= set(listed)  # the rest of the window
    assert "re_1" in listed  # and the other kind of object
    assert len(listed) == len(set(listed))


def test_a_stripe_effect_is_adopted_under_its_namespace(
    store: Store, stripe: StripeProvider, router: respx.Router
) -> None:
    router.get("/v1/payment_intents").mock(return_value=page(intent("pi_lost", **OURS)))
    router.get("/v1/refunds").mock(return_value=page())
    since = datetime(2024, 5, 1, tzinfo=UTC)

    report = scan(
        store,
        stripe,
        since=since,
        until=since + timedelta(days=1),
        adopt_found=True,
        actor="alice",
        reason="lost",
        registry=default_registry("stripe"),
    )

    (finding,) = report.findings
    adopted = store.get(TENANT, finding.operation_id or "")
    assert (adopted.provider, adopted.state, adopted.currency) == ("stripe", State.SUCCEEDED, "EUR")
    assert adopted.downstream_key == downstream_key(OURS["payorch_ref"])
    assert adopted.fingerprint == OURS["payorch_fingerprint"]
