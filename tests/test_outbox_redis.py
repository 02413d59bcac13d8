"""The Redis Streams sink against a real redis-server the tests start (tests/redis_server.py).

What is proved: every field reaches the stream; a re-send of one message id within the
dedupe window appends nothing; one aggregate's messages keep their order; a failed append
leaves no dedupe mark behind (so the retry appends); a stopped server is a DeliveryFailed;
and a consumer group reads each entry at least once (unacknowledged ones come back).
"""

from __future__ import annotations

import json
import socket
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import redis
from outbox_receiver import CREATED, message

from payorch.errors import ConfigurationError, DeliveryFailed
from payorch.outbox import Message, Relay, find, stage
from payorch.outbox._sinks import Sink
from payorch.outbox.redis import (
    FIELDS,
    RedisStreamReader,
    RedisStreamSink,
    StreamEntry,
    dedupe_key,
)
from payorch.storage._store import Store

if TYPE_CHECKING:
    from redis_server import RedisServer

# The fixtures (imported here, not above: a plugin module must be imported by pytest first,
# to have its asserts rewritten).
pytest_plugins = ["redis_server"]


@pytest.fixture
def client(redis_url: str) -> Any:
    c = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    yield c
    c.close()


@pytest.fixture
def sink(redis_url: str) -> Any:
    s = RedisStreamSink(redis_url)
    yield s
    s.close()


def test_is_a_sink(sink: RedisStreamSink) -> None:
    assert isinstance(sink, Sink)
    assert sink.deadline == 6.0  # two tries of a connect (1 s) and a round trip (2 s)


def test_delivered_message_is_in_the_stream_with_every_field(
    sink: RedisStreamSink, client: Any
) -> None:
    m = message()
    sink.deliver(m)
    entries = client.xrange("payorch:t1:payment")
    assert len(entries) == 1
    _, fields = entries[0]
    assert set(fields) == set(FIELDS)
    assert fields["id"] == m.id
    assert fields["type"] == "payment.succeeded"
    assert fields["tenant_id"] == "t1"
    assert fields["aggregate_type"] == "payment"
    assert fields["aggregate_id"] == "op-1"
    assert json.loads(fields["payload"]) == {"amount": 4200, "currency": "EUR", "note": "café"}
    assert fields["operation_id"] == "op-1"
    assert datetime.fromisoformat(fields["created_at"]) == CREATED


def test_no_operation_id_is_an_empty_field(sink: RedisStreamSink, client: Any) -> None:
    sink.deliver(message(operation_id=None))
    [(_, fields)] = client.xrange("payorch:t1:payment")
    assert fields["operation_id"] == ""


def test_resend_within_the_window_appends_nothing(sink: RedisStreamSink, client: Any) -> None:
    m = message()
    first = sink.publish(m)
    # The relay re-sends after a crash or a lost reply: a later attempt, the same id.
    again = sink.publish(message(id=m.id, attempt=2))
    sink.deliver(message(id=m.id, attempt=3))
    assert again == first
    assert client.xlen("payorch:t1:payment") == 1
    ttl_ms = client.pttl(dedupe_key("payorch:t1:payment", m))
    assert 0 < ttl_ms <= timedelta(days=1).total_seconds() * 1000


def test_dedupe_window_is_the_mark_lifetime(redis_url: str, client: Any) -> None:
    sink = RedisStreamSink(redis_url, dedupe_window=timedelta(minutes=5))
    try:
        m = message()
        sink.deliver(m)
        ttl_ms = client.pttl(dedupe_key("payorch:t1:payment", m))
        assert 0 < ttl_ms <= 5 * 60 * 1000
        # Past the window (the mark gone), the same id is appended again: the window is
        # what dedupes, nothing else.
        client.delete(dedupe_key("payorch:t1:payment", m))
        sink.deliver(m)
        assert client.xlen("payorch:t1:payment") == 2
    finally:
        sink.close()


def test_same_id_in_another_tenant_is_another_message(sink: RedisStreamSink, client: Any) -> None:
    shared = str(uuid.uuid4())
    sink.deliver(message(id=shared, tenant_id="t1"))
    sink.deliver(message(id=shared, tenant_id="t2"))
    assert client.xlen("payorch:t1:payment") == 1
    assert client.xlen("payorch:t2:payment") == 1


def test_one_aggregates_messages_keep_their_order(sink: RedisStreamSink, client: Any) -> None:
    kinds = ["payment.authorised", "payment.captured", "payment.refunded", "payment.closed"]
    sent = [message(type=kind, aggregate_id="op-7") for kind in kinds]
    # Another aggregate's messages interleaved on the same stream change nothing.
    for m in sent:
        sink.deliver(m)
        sink.deliver(message(aggregate_id="op-8"))
    sink.deliver(sent[1])  # a late re-send keeps its first place
    entries = client.xrange("payorch:t1:payment")
    mine = [f["id"] for _, f in entries if f["aggregate_id"] == "op-7"]
    assert mine == [m.id for m in sent]


def test_stream_template_and_function(redis_url: str, client: Any) -> None:
    templated = RedisStreamSink(redis_url, stream="events.{destination}.{tenant_id}")
    routed = RedisStreamSink(redis_url, stream=lambda m: f"by-type:{m.type}")
    try:
        templated.deliver(message())
        routed.deliver(message(type="refund.succeeded"))
        assert client.xlen("events.broker.t1") == 1
        assert client.xlen("by-type:refund.succeeded") == 1
        assert templated.stream_for(message(tenant_id="t9")) == "events.broker.t9"
    finally:
        templated.close()
        routed.close()


def test_maxlen_trims_the_stream(redis_url: str, client: Any) -> None:
    sink = RedisStreamSink(redis_url, maxlen=1)
    try:
        for _ in range(300):  # approximate trimming acts a macro node (100 entries) at a time
            sink.deliver(message())
        assert client.xlen("payorch:t1:payment") < 300
    finally:
        sink.close()


def test_callers_client_is_used_and_left_open(redis_url: str) -> None:
    mine = redis.Redis.from_url(redis_url, socket_timeout=5)  # bytes replies, not text
    sink = RedisStreamSink(mine)
    try:
        m = message()
        entry_id = sink.publish(m)
        assert sink.publish(m) == entry_id
        sink.close()
        assert mine.ping()  # still the caller's
        assert sink.deadline is None  # its time-outs are the caller's to know
    finally:
        mine.close()


def test_a_failed_append_leaves_no_mark(sink: RedisStreamSink, client: Any) -> None:
    # A key of the wrong type makes XADD fail inside the script: the dedupe mark must not
    # be set, or the retry would be dropped as a duplicate and the message lost.
    client.set("payorch:t1:payment", "not a stream")
    m = message()
    with pytest.raises(DeliveryFailed, match="redis: ResponseError"):
        sink.deliver(m)
    assert client.exists(dedupe_key("payorch:t1:payment", m)) == 0
    client.delete("payorch:t1:payment")
    sink.deliver(m)
    assert client.xlen("payorch:t1:payment") == 1


def test_stopped_server_is_delivery_failed(fresh_redis_server: RedisServer) -> None:
    sink = RedisStreamSink(fresh_redis_server.url(), socket_timeout=2, connect_timeout=1)
    try:
        sink.deliver(message())  # a pooled connection exists now
        fresh_redis_server.stop()
        with pytest.raises(DeliveryFailed, match="redis: ConnectionError") as caught:
            sink.deliver(message())
        assert caught.value.retry_after is None  # the relay's backoff decides
        with pytest.raises(DeliveryFailed, match="redis: ConnectionError"):
            sink.deliver(message())  # and again: the sink itself never loops
    finally:
        sink.close()


def test_unreachable_url_is_delivery_failed() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = RedisStreamSink(f"redis://127.0.0.1:{port}/0", connect_timeout=1)
    try:
        with pytest.raises(DeliveryFailed, match="redis: ConnectionError"):
            sink.deliver(message())
    finally:
        sink.close()


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"stream": "payorch:{tenant}"}, "may name only"),
        ({"stream": "payorch:{}"}, "may name only"),
        ({"stream": ""}, "non-empty template"),
        ({"dedupe_window": timedelta(0)}, "dedupe_window"),
        ({"maxlen": 0}, "maxlen"),
        ({"socket_timeout": 0.0}, "socket_timeout"),
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(ConfigurationError, match=text):
        RedisStreamSink("redis://127.0.0.1:1/0", **kwargs)


def test_bad_url_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="invalid Redis URL"):
        RedisStreamSink("http://127.0.0.1:1/0")
    with pytest.raises(ConfigurationError, match=r"a redis:// URL"):
        RedisStreamSink(42)  # type: ignore[arg-type]


def test_dedupe_key_shares_the_streams_hash_slot() -> None:
    m = message(id="m1")
    assert dedupe_key("payorch:t1:payment", m) == "{payorch:t1:payment}:dedupe:t1:m1"
    # A stream already placed by a hash tag keeps it.
    assert dedupe_key("orders:{t1}:x", m) == "orders:{t1}:x:dedupe:t1:m1"


# -- the consumer side ----------------------------------------------------------------------


def test_reader_reads_each_entry_at_least_once(sink: RedisStreamSink, redis_url: str) -> None:
    sent = [message(aggregate_id="op-3", type=f"step.{i}") for i in range(3)]
    reader = RedisStreamReader(
        redis_url, stream="payorch:t1:payment", group="receipts", consumer="c1"
    )
    try:
        reader.ensure_group()
        reader.ensure_group()  # an existing group is fine
        for m in sent:
            sink.deliver(m)
        first = reader.read(count=10)
        assert [e.id for e in first] == [m.id for m in sent]
        assert all(isinstance(e, StreamEntry) and e.tenant_id == "t1" for e in first)
        assert first[0].payload() == sent[0].payload
        # Processed only the first, then "crashed": the others come back, in order.
        assert reader.ack(first[0]) == 1
        again = reader.read(count=10)
        assert [e.id for e in again] == [m.id for m in sent[1:]]
        assert reader.ack(*again) == 2
        assert reader.read(count=10) == []
    finally:
        reader.close()


def test_reader_claims_what_another_consumer_left(sink: RedisStreamSink, redis_url: str) -> None:
    crashed = RedisStreamReader(redis_url, stream="payorch:t1:payment", group="g", consumer="a")
    taker = RedisStreamReader(redis_url, stream="payorch:t1:payment", group="g", consumer="b")
    try:
        crashed.ensure_group()
        m = message()
        sink.deliver(m)
        assert [e.id for e in crashed.read()] == [m.id]  # read, never acked
        assert taker.read() == []  # not delivered twice to the group by itself
        claimed = taker.claim_idle(min_idle=timedelta(0))
        assert [e.id for e in claimed] == [m.id]
        assert taker.ack(*claimed) == 1
    finally:
        crashed.close()
        taker.close()


def test_reader_acks_pending_entries_trimmed_away(redis_url: str, client: Any) -> None:
    reader = RedisStreamReader(redis_url, stream="s", group="g", consumer="c")
    try:
        reader.ensure_group()
        client.xadd("s", {"id": "m1"})
        client.xadd("s", {"id": "m2"})
        assert [e.id for e in reader.read()] == ["m1", "m2"]
        client.xtrim("s", maxlen=1, approximate=False)  # m1 gone while still pending
        assert [e.id for e in reader.read()] == ["m2"]
        assert client.xpending("s", "g")["pending"] == 1  # m1 was acked: nothing to do
    finally:
        reader.close()


def test_reader_blocks_for_new_entries_within_its_socket_timeout(
    sink: RedisStreamSink, redis_url: str
) -> None:
    reader = RedisStreamReader(redis_url, stream="payorch:t1:payment", group="g", consumer="c")
    try:
        reader.ensure_group()
        assert reader.read(block=timedelta(milliseconds=10)) == []  # nothing came
        m = message()
        sink.deliver(m)
        assert [e.id for e in reader.read(block=timedelta(seconds=1))] == [m.id]
        with pytest.raises(ConfigurationError, match="block must be shorter"):
            reader.read(block=timedelta(seconds=30))
    finally:
        reader.close()


# -- through the relay ------------------------------------------------------------------------


def test_through_the_relay_an_aggregates_messages_reach_the_stream_in_order(
    store: Store, redis_url: str, client: Any
) -> None:
    with store.engine.begin() as conn:
        ids = stage(
            conn,
            [Message(f"order.step{n}", "order", "o-1", {"n": n}) for n in range(4)],
            tenant_id="shop",
        )
    # The default policy: its lease outlasts a batch of the sink's deadline.
    with Relay(store, {"default": RedisStreamSink(redis_url)}) as relay:
        for _ in range(10):  # one aggregate: one message per pass, in order
            if relay.drain().leased == 0:
                break
    entries = client.xrange("payorch:shop:order")
    assert [f["id"] for _, f in entries] == ids
    assert [json.loads(f["payload"]) for _, f in entries] == [{"n": n} for n in range(4)]
    assert all(find(store, i).state == "delivered" for i in ids)
