"""Every provider call has a total deadline: a trickled answer cannot outlast the lease.

httpx's read and write time-outs apply per socket operation, so a body sent one byte per
(read time-out - ε) never times out. ``send_with_deadline`` bounds the whole call; a deadline
hit after the request may have been written is ``outcome_unknown``, settled from evidence.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta

import httpx
import pytest
from conftest import FAST_TIMEOUT, RecordingSleep, effects_of, make_due

from payorch.core import State
from payorch.errors import ConfigurationError
from payorch.execution._executor import Executor
from payorch.operations import default_registry
from payorch.provider import (
    AnswerKind,
    DeadlineExceeded,
    answer_from_transport_error,
    call_budget,
    send_with_deadline,
)
from payorch.providers.sandbox import Fault, SandboxProvider, SandboxServer
from payorch.providers.stripe import StripeProvider
from payorch.reconciling._reconciler import Reconciler, ReconcilerPolicy
from payorch.storage._store import Store

PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "cus_7"}
SHORT = timedelta(seconds=1)  # the call deadline under test
GAP = 0.05
# Every trickled byte arrives well within this read time-out (forty gaps, so a stalled
# thread cannot make it fire instead of the deadline); a whole effect (a few hundred bytes)
# takes many seconds, far past SHORT; an answer sent at once takes milliseconds.
TRICKLE_TIMEOUT = httpx.Timeout(connect=1.0, read=2.0, write=1.0, pool=1.0)


# -- against the sandbox: the executor and the reconciler --------------------------------


@pytest.fixture
def trickling() -> Iterator[SandboxServer]:
    with SandboxServer(trickle_interval=GAP) as sb:
        yield sb


@pytest.fixture
def short_provider(trickling: SandboxServer) -> Iterator[SandboxProvider]:
    with SandboxProvider(base_url=trickling.url, timeout=TRICKLE_TIMEOUT, deadline=SHORT) as p:
        yield p


def test_a_trickled_answer_ends_at_the_deadline_unknown_then_settles_once(
    store: Store, trickling: SandboxServer, short_provider: SandboxProvider
) -> None:
    executor = Executor(
        store=store,
        providers=[short_provider],
        registry=default_registry("sandbox"),
        lease=timedelta(seconds=10),
        sleep=RecordingSleep(),
        owner="test-executor",
    )
    trickling.inject(Fault.TRICKLE)
    outcome = executor.execute(
        tenant_id="shop", operation="payment.create", idempotency_key="k1", request=PAYMENT
    )
    # The provider committed and began answering: possibly sent, so unknown, never retried.
    assert outcome.state is State.OUTCOME_UNKNOWN
    assert outcome.error_code == "deadline_exceeded"
    last = store.events("shop", outcome.operation_id)[-1]
    assert last.detail is not None
    assert last.detail["code"] == "deadline_exceeded" and last.detail["possibly_sent"] is True
    assert last.detail["attempt"] == 1
    assert len(effects_of(trickling, store, "shop", outcome.operation_id)) == 1

    make_due(store, outcome.operation_id)
    reconciler = Reconciler(
        store=store,
        providers=[short_provider],
        policy=ReconcilerPolicy(lease=timedelta(seconds=10)),
        owner="test-reconciler",
    )
    report = reconciler.reconcile_once()
    assert report.outcomes == Counter({"succeeded": 1})
    record = store.get("shop", outcome.operation_id)
    assert record.state is State.SUCCEEDED and record.resolution == "status_query"
    effects = effects_of(trickling, store, "shop", outcome.operation_id)
    assert len(effects) == 1 and record.provider_reference == effects[0]["id"]


def test_a_lease_shorter_than_the_deadline_is_refused_at_start_up(
    store: Store, trickling: SandboxServer
) -> None:
    slow = SandboxProvider(
        base_url=trickling.url, timeout=FAST_TIMEOUT, deadline=timedelta(seconds=20)
    )
    # 60 s covered the time-outs (3.5 s per call); not a 20 s deadline.
    with pytest.raises(ConfigurationError, match="lease"):
        Executor(
            store=store,
            providers=[slow],
            registry=default_registry("sandbox"),
            lease=timedelta(seconds=60),
        )
    # Left out, the lease is the adapter's worst case: 4 attempts of 20 s and the backoff.
    fitted = Executor(store=store, providers=[slow], registry=default_registry("sandbox"))
    assert fitted.lease >= fitted.lease_needed(slow) > timedelta(seconds=80)
    with pytest.raises(ConfigurationError, match="lease"):
        Reconciler(
            store=store,
            providers=[slow],
            policy=ReconcilerPolicy(lease=timedelta(seconds=30)),
        )
    slow.close()


def test_the_deadline_is_the_call_bound_and_defaults_to_the_time_outs() -> None:
    base = "http://127.0.0.1:1"
    assert SandboxProvider(base_url=base, deadline=SHORT).max_call_duration == SHORT
    default = SandboxProvider(base_url=base, timeout=FAST_TIMEOUT)
    assert default.max_call_duration == call_budget(FAST_TIMEOUT) == timedelta(seconds=5)
    stripe = StripeProvider(api_key="sk_test_x", deadline=SHORT)
    assert stripe.max_call_duration == SHORT
    for bad in (timedelta(0), timedelta(seconds=-1)):
        with pytest.raises(ConfigurationError, match="deadline"):
            SandboxProvider(base_url=base, deadline=bad)
        with pytest.raises(ConfigurationError, match="deadline"):
            StripeProvider(api_key="sk_test_x", deadline=bad)


# -- the helper against a raw loopback server --------------------------------------------


class SlowServer:
    """Answers every request on 127.0.0.1 by ``respond(conn)``; counts requests received.

    Each connection is served by one thread; ``close`` unblocks and joins them all.
    """

    def __init__(self, respond: Callable[[socket.socket], None]) -> None:
        self._respond = respond
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests = 0
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._connections.append(conn)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buffered = b""
            for _ in range(100):  # requests per connection, bounded
                while b"\r\n\r\n" not in buffered:
                    try:
                        chunk = conn.recv(65536)
                    except OSError:
                        return
                    if not chunk:
                        return
                    buffered += chunk
                _, buffered = buffered.split(b"\r\n\r\n", 1)  # GETs: no request body
                with self._lock:
                    self.requests += 1
                try:
                    self._respond(conn)
                except OSError:
                    return  # the client gave up

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone does not
        self._listener.close()
        self._accepting.join(5)
        with self._lock:
            connections, threads = list(self._connections), list(self._threads)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(5)


def trickle(data: bytes, stop: threading.Event) -> Callable[[socket.socket], None]:
    """A responder sending ``data`` one byte per GAP until done or ``stop``."""

    def respond(conn: socket.socket) -> None:
        for i in range(len(data)):
            if i and stop.wait(GAP):
                return
            conn.sendall(data[i : i + 1])

    return respond


BODY = b"x" * 400
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 400\r\n\r\n"


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def _deadline_error(server: SlowServer, timeout: httpx.Timeout) -> DeadlineExceeded:
    with httpx.Client(timeout=timeout) as client:
        request = client.build_request("GET", server.url + "/slow")
        with pytest.raises(DeadlineExceeded) as caught:
            send_with_deadline(client, request, deadline=time.monotonic() + 0.3)
    return caught.value


@pytest.mark.parametrize("trickled", ["body", "headers"])
def test_a_trickled_response_raises_the_deadline_as_possibly_sent(
    stop: threading.Event, trickled: str
) -> None:
    """Per-read time-outs never fire (each gap is shorter), the deadline does."""

    def respond(conn: socket.socket) -> None:
        if trickled == "body":
            conn.sendall(HEAD)
            trickle(BODY, stop)(conn)
        else:
            trickle(HEAD + BODY, stop)(conn)

    server = SlowServer(respond)
    try:
        # A read time-out a hundred gaps long: a stalled thread cannot make it fire first.
        error = _deadline_error(server, httpx.Timeout(5.0))
    finally:
        stop.set()
        server.close()
    assert error.possibly_sent is True
    answer = answer_from_transport_error(error)
    assert answer.kind is AnswerKind.AMBIGUOUS and answer.code == "deadline_exceeded"
    assert server.requests == 1


def test_a_deadline_hit_waiting_for_a_pool_slot_is_not_sent(stop: threading.Event) -> None:
    """The only connection is busy: the second call never writes a byte, even later."""
    held = threading.Event()
    release = threading.Event()

    def respond(conn: socket.socket) -> None:
        if not held.is_set():  # the first request holds the only connection
            held.set()
            release.wait(10)
        conn.sendall(HEAD + BODY)

    server = SlowServer(respond)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    first: list[httpx.Response] = []
    try:
        with httpx.Client(timeout=httpx.Timeout(5.0), limits=limits) as client:

            def occupy() -> None:
                request = client.build_request("GET", server.url + "/held")
                first.append(send_with_deadline(client, request, deadline=time.monotonic() + 10))

            holder = threading.Thread(target=occupy)
            holder.start()
            assert held.wait(10)
            request = client.build_request("GET", server.url + "/second")
            with pytest.raises(DeadlineExceeded) as caught:
                send_with_deadline(client, request, deadline=time.monotonic() + 0.2)
            release.set()
            holder.join(10)
            # The freed connection takes a request again: the abandoned one never used it.
            after = client.build_request("GET", server.url + "/after")
            last = send_with_deadline(client, after, deadline=time.monotonic() + 5)
    finally:
        release.set()
        server.close()
    assert caught.value.possibly_sent is False
    answer = answer_from_transport_error(caught.value)
    assert answer.kind is AnswerKind.NOT_SENT and answer.code == "deadline_exceeded"
    assert [r.status_code for r in first] == [200] and last.content == BODY
    assert server.requests == 2  # the held one and the last one; never the abandoned one


def test_an_answer_within_the_deadline_is_returned_whole(stop: threading.Event) -> None:
    server = SlowServer(lambda conn: conn.sendall(HEAD + BODY))
    try:
        with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
            request = client.build_request("GET", server.url + "/fast")
            response = send_with_deadline(client, request, deadline=time.monotonic() + 5)
    finally:
        server.close()
    assert response.status_code == 200 and response.content == BODY
    assert response.is_closed


def test_transport_errors_pass_through_unchanged() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
    with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
        request = client.build_request("GET", f"http://127.0.0.1:{port}/")
        with pytest.raises(httpx.ConnectError) as caught:
            send_with_deadline(client, request, deadline=time.monotonic() + 5)
    assert answer_from_transport_error(caught.value).kind is AnswerKind.NOT_SENT


def test_a_transport_that_announces_nothing_is_possibly_sent_at_the_deadline() -> None:
    """A mock or custom transport gives no sign of when it writes: assume it did."""
    release = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        release.wait(10)
        return httpx.Response(200)

    try:
        with httpx.Client(transport=httpx.MockTransport(handler)) as client:
            request = client.build_request("GET", "http://127.0.0.1:1/")
            with pytest.raises(DeadlineExceeded) as caught:
                send_with_deadline(client, request, deadline=time.monotonic() + 0.2)
    finally:
        release.set()
    assert caught.value.possibly_sent is True


# -- the kept worker threads ---------------------------------------------------------------


class _Watched(list):  # type: ignore[type-arg]
    """The idle list of a ``_Workers``: says when a worker has parked itself."""

    def __init__(self) -> None:
        super().__init__()
        self.parked = threading.Semaphore(0)

    def append(self, item: object) -> None:
        super().append(item)
        self.parked.release()


def _job(ran: list[threading.Thread], finished: threading.Event) -> Callable[[], None]:
    def job() -> None:
        ran.append(threading.current_thread())
        finished.set()

    return job


def test_an_idle_worker_takes_the_next_call() -> None:
    from payorch.clients import _Workers

    workers = _Workers(keep=1, idle_for=60)
    idle = workers._idle = _Watched()
    ran: list[threading.Thread] = []
    first, second = threading.Event(), threading.Event()
    workers.run(_job(ran, first))
    assert first.wait(30)
    assert idle.parked.acquire(timeout=30)  # the worker is idle now
    workers.run(_job(ran, second))
    assert second.wait(30)
    assert ran[0] is ran[1]  # the same thread ran both: no thread started for the second
    assert idle.parked.acquire(timeout=30)
    assert list(idle) != []  # parked again, ready for a third


def test_workers_beyond_keep_or_idle_too_long_end() -> None:
    from payorch.clients import _Workers

    for workers in (_Workers(keep=0, idle_for=60), _Workers(keep=1, idle_for=0.01)):
        ran: list[threading.Thread] = []
        finished = threading.Event()
        workers.run(_job(ran, finished))
        assert finished.wait(30)
        ran[0].join(30)  # keep=0: at once; idle_for: once its idle wait times out
        assert not ran[0].is_alive()
        assert workers._idle == []


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, 1.0),
        ("7", 7.0),
        ("-5", 0.0),
        ("soon", 1.0),
        ("inf", 1.0),
        ("nan", 1.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # an HTTP-date in the past: now
    ],
)
def test_retry_after_is_seconds_or_an_http_date_else_the_default(
    header: str | None, expected: float
) -> None:
    from payorch.clients import parse_retry_after

    assert parse_retry_after(header) == expected


def test_retry_after_as_an_http_date_in_the_future_is_the_wait_until_then() -> None:
    from datetime import UTC, datetime
    from email.utils import format_datetime

    from payorch.clients import parse_retry_after

    later = format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)
    assert 3000 < parse_retry_after(later) <= 3600
