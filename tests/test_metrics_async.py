"""The state gauges of an async service: one ``AsyncStore``, ``/metrics`` at its exact path.

A FastAPI app routes ``payorch.metrics.asgi_app(store=async_store)`` at ``/metrics`` and is
scraped through httpx's ASGI transport: 200 (no 307 to ``/metrics/``), the gauges carry what
the store holds, read on the event loop before each exposition, with the names, labels and
values the sync path reports. A slow read never holds the loop, overlapping scrapes share
one read, and a hung one answers ``payorch_database_up 0`` within the time-out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import PlainTextResponse

from payorch import AsyncStore, Store, metrics
from payorch.core import State
from payorch.errors import ConfigurationError
from payorch.observing import _metrics
from payorch.operations import default_registry
from payorch.records import NewOperation

LEASE = timedelta(seconds=30)
BASE = "http://127.0.0.1"
GAUGES = {
    "by_state": {"in_progress": 4, "outcome_unknown": 3},
    "due": 2,
    "attention": 1,
    "oldest_unknown_age": 60.0,
}
# What the collector reports only when its read answered.
STATE_GAUGES = {
    "payorch_operations",
    "payorch_due_operations",
    "payorch_needs_attention_operations",
    "payorch_oldest_unknown_age_seconds",
}


@pytest.fixture(autouse=True)
def unwatched() -> Iterator[None]:
    """Each test watches its own store; none is left in the registry for the next."""
    yield
    assert metrics.registry is not None
    for gauges in list(_metrics._watched):
        metrics.registry.unregister(gauges)
    _metrics._watched.clear()


def _new(key: str) -> NewOperation:
    request = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
    prepared = default_registry("sandbox").prepare(
        tenant_id="t1", operation="payment.create", idempotency_key=key, request=request
    )
    return prepared.new


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The payorch gauges of an exposition: (name, labels) -> value."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge" and family.name.startswith("payorch_"):
            for s in family.samples:
                found[s.name, tuple(sorted(s.labels.items()))] = s.value
    return found


def _value(text: str, name: str, **labels: str) -> float:
    return _samples(text)[name, tuple(sorted(labels.items()))]


def _app(*, store: Any = None) -> FastAPI:
    app = FastAPI()
    app.add_route("/metrics", metrics.asgi_app(store=store, timeout=5.0))

    @app.get("/ping")
    def ping() -> PlainTextResponse:
        return PlainTextResponse("pong")

    return app


def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)


async def _fill(store: AsyncStore) -> None:
    """Known rows: 2 in progress, 3 unknown (1 flagged, 2 due now), 1 succeeded."""
    records = [
        (await store.claim(_new(f"k{i}"), owner="w", lease=LEASE)).operation for i in range(6)
    ]
    for i, record in enumerate(records[2:5]):
        record = await store.transition(
            record,
            State.OUTCOME_UNKNOWN,
            kind="submit_ambiguous",
            actor="test",
            next_check_in=timedelta(0) if i < 2 else timedelta(hours=1),
        )
        if i == 2:
            await store.flag_attention(record, kind="escalated", actor="test", detail={})
    await store.transition(
        records[5],
        State.SUCCEEDED,
        kind="provider_answer",
        actor="test",
        provider_reference="pi_1",
        response={"status": 201, "body": {"id": "pi_1"}},
    )


def test_fastapi_serves_an_async_stores_gauges_at_metrics(db_url: str, store: Store) -> None:
    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with AsyncStore.from_url(db_url) as live, _client(_app(store=live)) as client:
            await _fill(live)
            first = await client.get("/metrics")
            # Read again before each exposition: a new claim shows in the next scrape.
            await live.claim(_new("k-late"), owner="w", lease=LEASE)
            second = await client.get("/metrics")
            slash = await client.get("/metrics/")
            return first, second, slash

    first, second, slash = asyncio.run(scenario())
    assert first.status_code == 200, first.text
    assert first.headers["content-type"].startswith("text/plain")
    assert _value(first.text, "payorch_database_up") == 1.0
    assert _value(first.text, "payorch_operations", state="in_progress") == 2.0
    assert _value(first.text, "payorch_operations", state="outcome_unknown") == 3.0
    assert _value(first.text, "payorch_due_operations") == 2.0
    assert _value(first.text, "payorch_needs_attention_operations") == 1.0
    assert _value(first.text, "payorch_outbox_messages", state="dead") == 0.0
    assert _value(second.text, "payorch_operations", state="in_progress") == 3.0
    # The exact path answers; only the other spelling is redirected (Starlette's own rule).
    assert slash.status_code == 307 and slash.headers["location"].endswith("/metrics")

    # The sync path on the same database: the same names, labels and values (the age of
    # the oldest unknown aside: it grows between the two reads).
    metrics.watch(store)
    assert metrics.registry is not None
    sync_text = generate_latest(metrics.registry).decode()
    age = ("payorch_oldest_unknown_age_seconds", ())
    by_async, by_sync = _samples(second.text), _samples(sync_text)
    by_async.pop("payorch_reconciler_last_pass_timestamp_seconds", None)
    assert by_async.keys() == by_sync.keys()
    assert {k: v for k, v in by_async.items() if k != age} == {
        k: v for k, v in by_sync.items() if k != age
    }
    assert by_async[age] > 0
    if store.is_postgres:
        assert any(name == "payorch_database_replication_mode" for name, _ in by_async)


def test_a_sync_store_is_served_too_and_only_get_and_head(store: Store) -> None:
    async def scenario() -> list[httpx.Response]:
        async with _client(_app(store=store)) as client:
            return [
                await client.get("/metrics"),
                await client.head("/metrics"),
                await client.post("/metrics"),
            ]

    store.claim(_new("k-sync"), owner="w", lease=LEASE)
    got, head, post = asyncio.run(scenario())
    assert got.status_code == 200
    assert _value(got.text, "payorch_operations", state="in_progress") == 1.0
    assert head.status_code == 200 and head.content == b""
    assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
    assert post.text == "method not allowed: use GET or HEAD\n"


class GatedSource:
    """An async gauge source whose reads wait for the test to let them go."""

    def __init__(self) -> None:
        self.reads = 0
        self.cancelled = 0
        self.started = asyncio.Event()
        self.go = asyncio.Event()

    async def read_gauges(self) -> dict[str, Any]:
        self.reads += 1
        self.started.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return GAUGES


def test_a_pending_read_holds_neither_the_loop_nor_a_second_read() -> None:
    async def scenario() -> tuple[GatedSource, list[httpx.Response], bool]:
        source = GatedSource()
        async with _client(_app(store=source)) as client:
            scrapes = [asyncio.ensure_future(client.get("/metrics")) for _ in range(2)]
            await source.started.wait()
            # The loop serves another request while the gauge read is pending.
            ping = await client.get("/ping")
            pending = not any(s.done() for s in scrapes)
            source.go.set()
            answers = [await s for s in scrapes]
        return source, [ping, *answers], pending

    source, (ping, *answers), pending = asyncio.run(scenario())
    assert ping.text == "pong" and pending
    assert source.reads == 1  # the overlapping scrape joined the read in flight
    for answer in answers:
        assert answer.status_code == 200
        assert _value(answer.text, "payorch_operations", state="outcome_unknown") == 3.0
        assert _value(answer.text, "payorch_oldest_unknown_age_seconds") == 60.0


def test_a_hung_read_answers_database_up_0_and_is_cancelled() -> None:
    async def scenario() -> tuple[GatedSource, list[httpx.Response]]:
        source = GatedSource()  # never let go
        app = FastAPI()
        app.add_route("/metrics", metrics.asgi_app(store=source, timeout=0.2))
        async with _client(app) as client:
            return source, [await client.get("/metrics"), await client.get("/metrics")]

    source, answers = asyncio.run(scenario())
    for answer in answers:
        assert answer.status_code == 200
        assert _value(answer.text, "payorch_database_up") == 0.0
        assert not {name for name, _ in _samples(answer.text)} & STATE_GAUGES
    # Each read was cancelled at the time-out: nothing piles up behind a hung database.
    assert source.reads == 2 and source.cancelled == 2


def _collected(gauges: _metrics.StoreGauges) -> dict[str, float]:
    """What the collector reports now: gauge name -> value (unlabelled samples only)."""
    return {s.name: s.value for f in gauges.collect() for s in f.samples if not s.labels}


def test_a_refresh_after_a_time_out_reads_afresh_and_overlapping_ones_share() -> None:
    async def scenario() -> list[tuple[int, int, dict[str, float]]]:
        source = GatedSource()  # hung until the test lets it go
        gauges = _metrics.StoreGauges(source, timeout=0.01)
        seen = []
        for _ in range(2):  # back to back, no scrape in between
            await gauges.refresh()
            seen.append((source.reads, source.cancelled, _collected(gauges)))
        # Two scrapes at once share one read, which times out for both.
        await asyncio.gather(gauges.refresh(), gauges.refresh())
        seen.append((source.reads, source.cancelled, _collected(gauges)))
        source.go.set()  # the database answers again
        await gauges.refresh()
        seen.append((source.reads, source.cancelled, _collected(gauges)))
        return seen

    first, second, shared, recovered = asyncio.run(scenario())
    # Each refresh that timed out returned with its read cancelled, not still in flight,
    # so the next one made a read of its own.
    assert first == (1, 1, {"payorch_database_up": 0.0})
    assert second == (2, 2, {"payorch_database_up": 0.0})
    assert shared == (3, 3, {"payorch_database_up": 0.0})
    reads, cancelled, values = recovered
    assert (reads, cancelled) == (4, 3)
    assert values["payorch_database_up"] == 1.0
    assert values["payorch_due_operations"] == 2.0
    assert values["payorch_oldest_unknown_age_seconds"] == 60.0


def test_watch_refuses_what_is_no_store() -> None:
    with pytest.raises(ConfigurationError, match="needs a Store or an AsyncStore, not object"):
        metrics.watch(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="fix the call"):
        metrics.asgi_app(store=42)  # type: ignore[arg-type]
