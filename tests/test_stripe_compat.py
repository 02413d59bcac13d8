"""The Stripe adapter against any Stripe-compatible endpoint (issue 11, item 6): its base URL
and idempotency window from settings, and a listing where Search is unavailable (respx)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
import respx
from conftest import RecordingSleep, age, make_due

from payorch.cli._runtime import build_providers
from payorch.core import State
from payorch.errors import ConfigurationError
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.provider import Answer, AnswerKind, StatusQuery
from payorch.providers.stripe import IDEMPOTENCY_WINDOW, StripeProvider
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.settings import ProviderSettings
from payorch.storage._store import Store
from payorch.storage._tables import events

BASE = "http://127.0.0.1:12111/compat"
OP_ID = "0192c0de-7a1b-7c3d-8e4f-5a6b7c8d9e0f"  # UUIDv7: created at 0x0192c0de7a1b ms
CREATED = 0x0192C0DE7A1B // 1000
PI_ID = "pi_3MtwBwLkdIwHu7ix28a3tqPa"
PAYMENT = {"amount": 2000, "currency": "EUR", "payment_method": "pm_card_visa"}
FAST = httpx.Timeout(connect=1.0, read=2.0, write=1.0, pool=1.0)
NOT_ENABLED = {
    "error": {
        "type": "invalid_request_error",
        "message": "Search is not enabled for this account.",
    }
}


def intent(
    ident: str = PI_ID,
    *,
    operation_id: str = OP_ID,
    status: str = "succeeded",
    tags: dict[str, str] | None = None,
) -> Any:
    """A PaymentIntent; tagged as an operation of the earlier key form (``payorch:<id>:…``)
    unless ``tags`` gives the metadata payorch sends today (from the namespace)."""
    legacy = {"payorch_operation_id": operation_id, "payorch_operation": "payment.create"}
    return {
        "id": ident,
        "object": "payment_intent",
        "amount": 2000,
        "currency": "eur",
        "status": status,
        "capture_method": "automatic",
        "created": CREATED,
        "metadata": legacy if tags is None else tags,
    }


def page(*items: Any, has_more: bool = False) -> httpx.Response:
    body = {"object": "list", "url": "/v1/payment_intents", "data": list(items)}
    return httpx.Response(200, json={**body, "has_more": has_more})


def query(operation_id: str = OP_ID) -> StatusQuery:
    return StatusQuery(
        tenant_id="shop",
        operation="payment.create",
        operation_id=operation_id,
        downstream_key=f"payorch:{operation_id}:submit",
        provider_reference=None,
    )


@pytest.fixture
def router() -> respx.Router:
    return respx.Router(base_url=BASE, assert_all_called=False)


@pytest.fixture
def stripe(router: respx.Router) -> Iterator[StripeProvider]:
    transport = httpx.MockTransport(router.handler)
    with StripeProvider(
        api_key="sk_test_x", base_url=BASE, transport=transport, async_transport=transport
    ) as provider:
        yield provider


def both(stripe: StripeProvider, q: StatusQuery) -> list[Answer]:
    """The sync and the async path of one status query: one flow, the same answer."""

    async def run() -> Answer:
        try:
            return await stripe.aquery_status(q)
        finally:
            await stripe.aclose()

    return [stripe.query_status(q), asyncio.run(run())]


# -- base URL and idempotency window -----------------------------------------------------------


def test_a_custom_base_url_receives_every_call(
    stripe: StripeProvider, router: respx.Router
) -> None:
    route = router.get(f"/v1/payment_intents/{PI_ID}").mock(
        return_value=httpx.Response(200, json=intent())
    )
    q = StatusQuery(
        tenant_id="shop",
        operation="payment.create",
        operation_id=OP_ID,
        downstream_key=f"payorch:{OP_ID}:submit",
        provider_reference=PI_ID,
    )
    answers = both(stripe, q)
    assert [a.kind for a in answers] == [AnswerKind.SUCCEEDED] * 2
    assert {str(c.request.url) for c in route.calls} == {f"{BASE}/v1/payment_intents/{PI_ID}"}


def test_window_option_none_and_default() -> None:
    with StripeProvider(api_key="sk_test_x") as default:
        assert default.idempotency_window == IDEMPOTENCY_WINDOW
    with StripeProvider(api_key="sk_test_x", idempotency_window=None) as keyless:
        assert keyless.idempotency_window is None
    with pytest.raises(ConfigurationError, match="idempotency_window"):
        StripeProvider(api_key="sk_test_x", idempotency_window=timedelta(0))


def test_settings_reach_the_adapter_the_cli_and_daemon_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAYORCH_STRIPE_API_KEY", "sk_test_x")
    monkeypatch.setenv("PAYORCH_STRIPE_BASE_URL", BASE)
    monkeypatch.setenv("PAYORCH_STRIPE_IDEMPOTENCY_WINDOW_SECONDS", "0")
    providers = build_providers(ProviderSettings())
    try:
        stripe = next(p for p in providers if p.name == "stripe")
        assert isinstance(stripe, StripeProvider)
        assert stripe.idempotency_window is None  # 0 = the endpoint ignores keys
        with respx.mock(assert_all_called=True) as mock:
            route = mock.get(f"{BASE}/v1/payment_intents/{PI_ID}").mock(
                return_value=httpx.Response(200, json=intent())
            )
            q = StatusQuery(
                tenant_id="shop",
                operation="payment.create",
                operation_id=OP_ID,
                downstream_key="k",
                provider_reference=PI_ID,
            )
            assert stripe.query_status(q).kind is AnswerKind.SUCCEEDED
            assert route.call_count == 1
        monkeypatch.setenv("PAYORCH_STRIPE_IDEMPOTENCY_WINDOW_SECONDS", "3600")
        (hour,) = [p for p in build_providers(ProviderSettings()) if p.name == "stripe"]
        assert hour.idempotency_window == timedelta(hours=1)
    finally:
        for p in providers:
            p.close()  # type: ignore[attr-defined]


def test_negative_window_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAYORCH_STRIPE_IDEMPOTENCY_WINDOW_SECONDS", "-1")
    with pytest.raises(ValueError, match="stripe_idempotency_window_seconds"):
        ProviderSettings()


# -- Search unavailable: list the intents created around the operation ------------------------


@pytest.mark.parametrize(
    "unavailable",
    [
        httpx.Response(404, json={"error": {"type": "invalid_request_error", "message": "?"}}),
        httpx.Response(404, text="Not Found"),
        httpx.Response(400, json=NOT_ENABLED),
    ],
    ids=["stripe-404", "bare-404", "400-not-enabled"],
)
def test_search_unavailable_falls_back_to_the_list(
    stripe: StripeProvider, router: respx.Router, unavailable: httpx.Response
) -> None:
    search = router.get("/v1/payment_intents/search").mock(return_value=unavailable)
    listing = router.get("/v1/payment_intents").mock(
        return_value=page(intent("pi_other1", operation_id=str(uuid.uuid4())), intent())
    )
    answers = both(stripe, query())
    for answer in answers:
        assert answer.kind is AnswerKind.SUCCEEDED
        assert answer.provider_reference == PI_ID
        assert answer.duplicates == ()
    assert search.call_count == 2 and listing.call_count == 2
    params = listing.calls.last.request.url.params
    assert params["limit"] == "100"
    assert int(params["created[gte]"]) <= CREATED <= int(params["created[lte]"])
    # Late enough for a re-submission inside Stripe's 24-hour key window.
    assert int(params["created[lte]"]) >= CREATED + IDEMPOTENCY_WINDOW.total_seconds()


def test_the_list_is_paged_until_the_intent_is_found(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get("/v1/payment_intents/search").mock(return_value=httpx.Response(404))
    others = [intent(f"pi_other{i}", operation_id=str(uuid.uuid4())) for i in range(3)]
    listing = router.get("/v1/payment_intents").mock(
        side_effect=[page(*others, has_more=True), page(intent(status="processing"))]
    )
    answer = stripe.query_status(query())
    assert answer.kind is AnswerKind.PENDING and answer.provider_reference == PI_ID
    assert listing.calls[1].request.url.params["starting_after"] == "pi_other2"


def test_nothing_listed_is_not_found_not_unavailable(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get("/v1/payment_intents/search").mock(
        return_value=httpx.Response(400, json=NOT_ENABLED)
    )
    router.get("/v1/payment_intents").mock(return_value=page(intent("pi_x", operation_id="o")))
    assert [a.kind for a in both(stripe, query())] == [AnswerKind.NOT_FOUND] * 2


def test_two_intents_for_one_operation_are_reported(
    stripe: StripeProvider, router: respx.Router
) -> None:
    router.get("/v1/payment_intents/search").mock(return_value=httpx.Response(404))
    router.get("/v1/payment_intents").mock(
        return_value=page(intent(), intent("pi_second", status="canceled"))
    )
    answer = stripe.query_status(query())
    assert answer.kind is AnswerKind.SUCCEEDED and answer.duplicates == ("pi_second",)


def test_listing_is_bounded(stripe: StripeProvider, router: respx.Router) -> None:
    router.get("/v1/payment_intents/search").mock(return_value=httpx.Response(404))
    listing = router.get("/v1/payment_intents").mock(
        return_value=page(intent("pi_other", operation_id="o"), has_more=True)
    )
    answer = stripe.query_status(query())
    assert answer.kind is AnswerKind.AMBIGUOUS and answer.code == "too_many_intents"
    assert listing.call_count == 10


def test_a_search_refusal_that_is_not_unavailability_is_not_a_fallback(
    stripe: StripeProvider, router: respx.Router
) -> None:
    bad = {"error": {"type": "invalid_request_error", "message": "Invalid search query"}}
    router.get("/v1/payment_intents/search").mock(return_value=httpx.Response(400, json=bad))
    listing = router.get("/v1/payment_intents").mock(return_value=page(intent()))
    assert stripe.query_status(query()).kind is AnswerKind.AMBIGUOUS
    assert listing.call_count == 0


# -- the reconciler over such an endpoint (PostgreSQL and SQLite) -----------------------------


def _unknown(store: Store, stripe: StripeProvider, key: str) -> str:
    ex = Executor(
        store=store,
        providers=[stripe],
        registry=default_registry("stripe"),
        lease=timedelta(minutes=2),
        sleep=RecordingSleep(),
    )
    outcome = ex.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=PAYMENT
    )
    assert outcome.state is State.OUTCOME_UNKNOWN  # the 500 may follow a commit
    return outcome.operation_id


def _reconciler(store: Store, stripe: StripeProvider) -> Reconciler:
    return Reconciler(
        store=store,
        providers=[stripe],
        policy=ReconcilerPolicy(lease=timedelta(minutes=2), not_found_grace=timedelta(seconds=60)),
    )


def test_reconciler_settles_through_the_list_fallback(store: Store) -> None:
    router = respx.Router(base_url=BASE, assert_all_called=False)
    post = router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(500, json={"error": {"type": "api_error"}})
    )
    router.get("/v1/payment_intents/search").mock(return_value=httpx.Response(404))
    with StripeProvider(
        api_key="sk_test_x",
        base_url=BASE,
        timeout=FAST,
        transport=httpx.MockTransport(router.handler),
    ) as stripe:
        op_id = _unknown(store, stripe, "order-1")
        claimed = store.get("shop", op_id)
        # What the POST tagged the intent with: the namespace, never the operation id.
        sent = {
            k[len("metadata[") : -1]: v[0]
            for k, v in parse_qs(post.calls.last.request.content.decode()).items()
            if k.startswith("metadata[")
        }
        assert sent["payorch_ref"] == claimed.downstream_key.split(":")[1]
        assert "payorch_operation_id" not in sent
        stranger = {**sent, "payorch_ref": "0" * 32}  # another namespace's intent
        listing = router.get("/v1/payment_intents").mock(
            return_value=page(intent("pi_other", tags=stranger), intent(tags=sent))
        )
        make_due(store, op_id)
        report = _reconciler(store, stripe).reconcile_once()
    assert report.outcomes["succeeded"] == 1
    record = store.get("shop", op_id)
    assert record.state is State.SUCCEEDED and record.provider_reference == PI_ID
    assert not record.needs_attention  # the other namespace's intent is not a duplicate
    assert post.call_count == 1
    # A claim may re-create one a failover lost: the list reaches back by the key window.
    params = listing.calls.last.request.url.params
    created = claimed.created_at.timestamp()
    window = IDEMPOTENCY_WINDOW.total_seconds()
    assert int(params["created[gte]"]) <= created - window
    assert int(params["created[lte]"]) >= created + window


def test_window_none_never_resubmits(store: Store) -> None:
    """An endpoint that ignores keys: not found after the grace period is escalated, and the
    POST is never repeated (it could charge twice)."""
    router = respx.Router(base_url=BASE, assert_all_called=False)
    post = router.post("/v1/payment_intents").mock(
        return_value=httpx.Response(500, json={"error": {"type": "api_error"}})
    )
    router.get("/v1/payment_intents/search").mock(
        return_value=httpx.Response(400, json=NOT_ENABLED)
    )
    router.get("/v1/payment_intents").mock(return_value=page())
    with StripeProvider(
        api_key="sk_test_x",
        base_url=BASE,
        idempotency_window=None,
        timeout=FAST,
        transport=httpx.MockTransport(router.handler),
    ) as stripe:
        assert stripe.idempotency_window is None
        op_id = _unknown(store, stripe, "order-2")
        age(store, op_id, timedelta(minutes=5))  # past the not-found grace period
        make_due(store, op_id)
        report = _reconciler(store, stripe).reconcile_once()
    assert report.outcomes["escalated"] == 1
    record = store.get("shop", op_id)
    assert record.state is State.OUTCOME_UNKNOWN and record.needs_attention
    assert post.call_count == 1  # never re-sent
    with store.engine.connect() as conn:
        kinds = [
            r.kind for r in conn.execute(events.select().where(events.c.operation_id == op_id))
        ]
    assert "resubmit" not in kinds
