"""A forked child (gunicorn --preload, multiprocessing's fork) shares nothing live with its
parent: no database session, no provider connection, no LISTEN thread, no flight.

Two processes on one connection would read each other's results; a child closing what it
inherited would end the parent's session. Each test forks after the parent has used the
thing, lets the child use it and tidy up, and then checks both sides.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from conftest import LoopThread

from payorch.core import State
from payorch.execution._executor import Executor
from payorch.execution._flights import Flights
from payorch.forks import reset_in_child
from payorch.observing._bounded import OneAtATime
from payorch.operations import default_registry
from payorch.provider import StatusQuery
from payorch.providers.sandbox import SandboxProvider, SandboxServer
from payorch.providers.stripe import StripeProvider
from payorch.reconciling._reconciler import Reconciler
from payorch.storage._async_store import AsyncStore
from payorch.storage._bridge import run_bridged
from payorch.storage._driver_sql import run_sql
from payorch.storage._store import Store

PAYMENT = {"amount": 1200, "currency": "EUR", "customer": "cus_fork"}
QUERY = StatusQuery(
    tenant_id="shop",
    operation="payment.create",
    operation_id="op_fork",
    downstream_key="dk_fork",
    provider_reference="pi_fork",
)


CHILD_LIMIT = 60.0  # seconds: a child that hangs is killed and fails its test


def in_child(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()`` in a forked child; what it returned (JSON), or the test fails."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it ends here and never returns into pytest
        code = 1
        try:
            os.close(read_end)
            ok = False
            try:
                result = work()
                ok = True
            except BaseException as exc:
                result = {"error": repr(exc)}
            # What the child dropped is collected now, in the child: its finalizers must
            # not reach the parent's sessions either.
            gc.collect()
            payload = json.dumps(result).encode()
            while payload:
                payload = payload[os.write(write_end, payload) :]
            code = 0 if ok else 1
        finally:
            os._exit(code)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + CHILD_LIMIT
    try:
        while True:
            ready, _, _ = select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the forked child did not finish within {CHILD_LIMIT:g} s")
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode()
    assert os.waitstatus_to_exitcode(status) == 0, text
    result: dict[str, Any] = json.loads(text)
    return result


def backend(store: Store) -> int | None:
    """The PostgreSQL session a pooled statement runs on (None on SQLite)."""
    if not store.is_postgres:
        return None
    row = run_sql(store.engine, "SELECT pg_backend_pid()", {}, write=False)
    assert row is not None
    return int(row[0])


def pay(ex: Executor, key: str) -> State:
    outcome = ex.execute(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=PAYMENT
    )
    return outcome.state


def peers(sandbox: SandboxServer) -> list[str]:
    return [r["peer"] for r in sandbox.requests()]


def test_a_forked_child_executes_on_connections_of_its_own(
    store: Store, sandbox: SandboxServer
) -> None:
    provider = SandboxProvider(base_url=sandbox.url)
    ex = Executor(
        store=store,
        providers=[provider],
        registry=default_registry("sandbox"),
        lease=timedelta(minutes=5),
    )
    assert pay(ex, "before-fork") is State.SUCCEEDED
    parent_session = backend(store)
    seen = len(peers(sandbox))
    parent_peers = set(peers(sandbox))

    def child() -> dict[str, Any]:
        state = pay(ex, "in-child")
        session = backend(store)
        owner = ex.owner
        # What a child's exit handlers do: close everything it holds.
        store.close()
        provider.close()
        return {"state": state.value, "session": session, "owner": owner, "pid": os.getpid()}

    result = in_child(child)
    assert result["state"] == "succeeded"
    assert result["owner"].endswith(f":{result['pid']}")  # leases name the child
    child_peers = peers(sandbox)[seen:]
    assert child_peers, "the child reached the acquirer"
    assert not set(child_peers) & parent_peers  # never on the parent's keep-alive connection
    if store.is_postgres:
        assert result["session"] != parent_session

    # The parent goes on where it was: same session, nothing of the child's closing felt.
    assert pay(ex, "after-fork") is State.SUCCEEDED
    assert backend(store) == parent_session
    assert len(sandbox.ledger()) == 3  # one effect per operation, the child's included
    provider.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_forked_child_of_an_async_store_opens_its_own_session(
    db_url: str, loop_thread: LoopThread
) -> None:
    astore = AsyncStore.from_url(db_url)

    async def session() -> int | None:
        return await run_bridged(lambda: backend(astore.sync))

    parent = loop_thread.run(session())

    def child() -> dict[str, Any]:
        # A loop of the child's own; the parent's pool (and its loop) stay the parent's.
        async def use_and_close() -> int | None:
            mine = await session()
            await astore.close()
            return mine

        return {"session": asyncio.run(use_and_close())}

    assert in_child(child)["session"] != parent
    assert loop_thread.run(session()) == parent
    loop_thread.run(astore.close())


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_forked_child_listens_on_its_own_connection(store: Store) -> None:
    listener = store.listener()
    assert listener is not None
    assert listener.start(timeout=10)

    def child() -> dict[str, Any]:
        fresh = store.listener()
        assert fresh is not None
        return {"same": fresh is listener, "listening": fresh.listening}

    result = in_child(child)
    # The parent's listener in the child would claim to listen with no thread behind it.
    assert result == {"same": False, "listening": False}
    assert store.listener() is listener and listener.listening


def test_a_forked_child_never_joins_a_flight_led_in_its_parent() -> None:
    flights = Flights()
    namespace = ("shop", "payment.create", "k")
    flight, leads = flights.lead_or_join(namespace, "fp", may_join=True)
    assert flight is not None and leads

    def child() -> dict[str, Any]:
        # The parent's leader has no thread here: joining it would wait for nothing.
        _, child_leads = flights.lead_or_join(namespace, "fp", may_join=True)
        return {"leads": child_leads}

    assert in_child(child) == {"leads": True}
    joined, parent_leads = flights.lead_or_join(namespace, "fp", may_join=True)
    assert joined is flight and not parent_leads  # the parent's flight is untouched


class _Recorder(ThreadingHTTPServer):
    """Answers any GET with a Stripe-shaped 404, remembering the connection it came on."""

    daemon_threads = True

    def __init__(self) -> None:
        self.peers: list[str] = []
        super().__init__(("127.0.0.1", 0), _Answer)


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a second request may reuse the connection
    server: _Recorder

    def do_GET(self) -> None:
        self.server.peers.append(f"{self.client_address[0]}:{self.client_address[1]}")
        body = json.dumps({"error": {"type": "invalid_request_error", "code": "resource_missing"}})
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    server = _Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_forked_childs_stripe_adapter_opens_its_own_connection(
    recorder: _Recorder,
) -> None:
    host, port = recorder.server_address[:2]
    stripe = StripeProvider(
        api_key="sk_test_fork",
        base_url=f"http://{host!s}:{port}",
        timeout=httpx.Timeout(5.0),
    )
    query = QUERY
    stripe.query_status(query)
    parent_peers = list(recorder.peers)
    assert parent_peers

    def child() -> dict[str, Any]:
        stripe.query_status(query)
        stripe.close()
        return {}

    in_child(child)
    child_peers = recorder.peers[len(parent_peers) :]
    assert child_peers and not set(child_peers) & set(parent_peers)
    stripe.query_status(query)  # the parent's connection still serves it
    assert recorder.peers[-1] in parent_peers
    stripe.close()


def test_a_forked_childs_reconciler_leases_under_its_own_name(store: Store) -> None:
    # The owner fences leases (a check that lost its lease must not release a sibling's).
    reconciler = Reconciler(store=store, providers=[])
    named = Reconciler(store=store, providers=[], owner="shard-1")

    def child() -> dict[str, Any]:
        return {"owner": reconciler.owner, "named": named.owner, "pid": os.getpid()}

    result = in_child(child)
    assert result["owner"] == f"reconciler:{socket.gethostname()}:{result['pid']}"
    assert result["named"] == "shard-1"  # a name the caller chose stays theirs
    assert reconciler.owner.endswith(f":{os.getpid()}")


@dataclass(frozen=True)
class _Equal:
    """Equal to every other instance: the registry must still reset each one."""

    tag: str = "same"
    resets: list[str] = field(default_factory=list, compare=False, hash=False)


@dataclass
class _Unhashable:
    resets: list[str] = field(default_factory=list)


def test_every_registered_object_and_reset_runs_in_the_child() -> None:
    first, second, loose = _Equal(), _Equal(), _Unhashable()
    assert first == second
    reset_in_child(first, lambda obj: obj.resets.append("a"))
    reset_in_child(second, lambda obj: obj.resets.append("b"))
    reset_in_child(loose, lambda obj: obj.resets.append("c"))
    reset_in_child(loose, lambda obj: obj.resets.append("d"))  # a second reset adds to the first

    def child() -> dict[str, Any]:
        return {"first": first.resets, "second": second.resets, "loose": loose.resets}

    assert in_child(child) == {"first": ["a"], "second": ["b"], "loose": ["c", "d"]}
    assert first.resets == second.resets == loose.resets == []  # the parent's are untouched


def test_a_forked_child_renews_the_async_client_an_adapter_owns_beside_a_callers_client(
    recorder: _Recorder, loop_thread: LoopThread
) -> None:
    host, port = recorder.server_address[:2]
    caller = httpx.Client(timeout=5.0)  # the caller's: theirs to renew
    stripe = StripeProvider(
        api_key="sk_test_fork",
        base_url=f"http://{host!s}:{port}",
        timeout=httpx.Timeout(5.0),
        client=caller,
    )
    loop_thread.run(stripe.aquery_status(QUERY))
    parent_peers = list(recorder.peers)

    def child() -> dict[str, Any]:
        asyncio.run(stripe.aquery_status(QUERY))
        return {}

    in_child(child)
    child_peers = recorder.peers[len(parent_peers) :]
    assert child_peers and not set(child_peers) & set(parent_peers)
    loop_thread.run(stripe.aclose())
    caller.close()


def test_a_forked_child_probes_though_its_parents_probe_was_stuck() -> None:
    parent = os.getpid()
    release = threading.Event()

    def read() -> str:
        if os.getpid() == parent:
            release.wait(30)  # a hung database in the parent
        return "fresh"

    probe = OneAtATime(read, timeout=0.01)
    try:
        assert probe() is None  # the parent's read is stuck: no answer, no second thread
        # The child has no thread behind the parent's read: it must not wait on it forever.
        # Its own read answers at once, but a loaded machine may take a while to run the
        # thread it starts: wait long enough for that (a stuck call still answers None).
        probe.timeout = 30.0
        assert in_child(lambda: {"answer": probe()}) == {"answer": "fresh"}
    finally:
        release.set()


def test_a_forked_django_worker_builds_its_own_runtime() -> None:
    pytest.importorskip("django")
    from payorch.integrations._django_config import _Runtime

    runtime = _Runtime()
    loop = asyncio.new_event_loop()
    runtime.loop = loop  # as after the parent served an async view
    try:

        def child() -> dict[str, Any]:
            return {"loop": runtime.loop is None, "lock": runtime.lock.acquire(blocking=False)}

        # Its async views would otherwise be refused: the parent's loop is not running here.
        assert in_child(child) == {"loop": True, "lock": True}
        assert runtime.loop is loop
    finally:
        loop.close()
