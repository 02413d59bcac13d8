"""A wait on an operation in progress ends even when the LISTEN connection hangs.

The waiters' listener reaches PostgreSQL through a loopback proxy (``listen_url``) that can
stall its connection: bytes stop moving, nothing is closed, as with a peer that stops
answering. The operation is then settled from another store, on a connection of its own.
The waiter must still answer with the outcome (it re-reads on its own schedule instead of
trusting a NOTIFY or the listener's shared read to come), or with OperationInProgress once
its wait is over. Assertions are on outcomes; the futures' time-outs only catch a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import LoopThread
from pgproxy import LoopbackProxy

from payorch.core import State
from payorch.errors import OperationInProgress
from payorch.operations import default_registry
from payorch.records import ClaimResult, NewOperation
from payorch.storage import _waiting as waiting
from payorch.storage._async_store import AsyncStore
from payorch.storage._store import Store

pytestmark = pytest.mark.postgres

LEASE = timedelta(seconds=60)
_STALL_LIMIT = 120.0  # a stalled connection is let go at the latest then (or at teardown)


class StallingProxy(LoopbackProxy):
    """Stalls its connections on demand: bytes from the client (``stall("client")``: the
    listener's next statement never reaches the server) or from both sides (``"both"``: a
    NOTIFY never reaches the listener either) stay in the proxy until ``release``."""

    def __init__(self, host: str, port: int) -> None:
        self._stalling: str | None = None
        self._released = threading.Event()
        self.stalled = threading.Event()  # some bytes are being held
        super().__init__(host, port)

    def stall(self, direction: str) -> None:
        self._stalling = direction

    def release(self) -> None:
        self._stalling = None
        self._released.set()

    def _hold(self) -> None:
        # Blocks this connection's pump: nothing moves either way, nothing is closed.
        self.stalled.set()
        self._released.wait(_STALL_LIMIT)

    def on_client(self, flow: dict[str, Any], data: bytes) -> None:
        if self._stalling is not None:
            self._hold()

    def on_server(self, flow: dict[str, Any], data: bytes) -> bool:
        if self._stalling == "both":
            self._hold()
        return True


@pytest.fixture(autouse=True)
def _prompt_safety_net(monkeypatch: pytest.MonkeyPatch) -> None:
    # What matters is that waiters re-read on their own at this pace, not how slow it is.
    monkeypatch.setattr(waiting, "_POLL_CAP", 2.0)


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[StallingProxy]:
    url = sa.make_url(postgres_url)
    p = StallingProxy(url.host or "127.0.0.1", url.port or 5432)
    try:
        yield p
    finally:
        p.release()
        p.close()


def new(key: str) -> NewOperation:
    registry = default_registry("sandbox")
    request = {"amount": 100, "currency": "EUR", "customer": "cus_1"}
    return registry.prepare(
        tenant_id="shop", operation="payment.create", idempotency_key=key, request=request
    ).new


Claim = Callable[[NewOperation, timedelta], ClaimResult]


@pytest.fixture(params=["sync", "async"])
def waiter(
    request: pytest.FixtureRequest, postgres_url: str, proxy: StallingProxy
) -> Iterator[tuple[Claim, Store]]:
    """A store whose waiters listen through the proxy: its ``claim(new, wait)`` (sync, or
    the async store's on an event loop) and the sync store holding the listener."""
    listen_url = proxy.url(postgres_url)
    if request.param == "sync":
        store = Store.from_url(postgres_url, listen_url=listen_url)
        try:
            yield (lambda n, wait: store.claim(n, owner="waiter", lease=LEASE, wait=wait)), store
        finally:
            store.close()
        return
    loop: LoopThread = request.getfixturevalue("loop_thread")
    astore = AsyncStore.from_url(postgres_url, listen_url=listen_url)
    try:
        yield (
            (lambda n, wait: loop.run(astore.claim(n, owner="waiter", lease=LEASE, wait=wait))),
            astore.sync,
        )
    finally:
        loop.run(astore.close())


@pytest.fixture
def holder(postgres_url: str) -> Iterator[Store]:
    """Another process's store: it claims and settles, on connections of its own."""
    store = Store.from_url(postgres_url)
    try:
        yield store
    finally:
        store.close()


def _listening(store: Store) -> None:
    listener = store.listener()
    assert listener is not None and listener.start(timeout=30)


@pytest.mark.parametrize("direction", ["client", "both"])
def test_a_waiter_gets_the_outcome_though_the_listen_connection_hangs(
    waiter: tuple[Claim, Store], holder: Store, proxy: StallingProxy, direction: str
) -> None:
    claim, waiting_store = waiter
    _listening(waiting_store)
    op = holder.claim(new("hang"), owner="holder", lease=LEASE).operation
    with ThreadPoolExecutor(1) as pool:
        waited = pool.submit(claim, new("hang"), timedelta(seconds=60))
        listener = waiting_store.listener()
        assert listener is not None and listener.wait_for_waiters(1, timeout=30)
        # "client": the NOTIFY arrives, the listener's read for the waiter hangs.
        # "both": the NOTIFY never arrives.
        proxy.stall(direction)
        holder.transition(op, State.SUCCEEDED, kind="provider_answer", actor="holder")
        result = waited.result(timeout=90)
    assert proxy.stalled.is_set() or direction == "both"
    assert (result.operation.id, result.operation.state, result.replayed) == (
        op.id,
        State.SUCCEEDED,
        True,
    )


def test_a_wait_that_ends_is_in_progress_though_the_listen_connection_hangs(
    waiter: tuple[Claim, Store], holder: Store, proxy: StallingProxy
) -> None:
    claim, waiting_store = waiter
    _listening(waiting_store)
    op = holder.claim(new("still"), owner="holder", lease=LEASE).operation
    proxy.stall("both")
    with ThreadPoolExecutor(1) as pool:
        waited = pool.submit(claim, new("still"), timedelta(seconds=1))
        with pytest.raises(OperationInProgress) as caught:
            waited.result(timeout=90)
    assert caught.value.operation_id == op.id


def test_a_stuck_listen_connection_is_cut_and_the_listener_listens_again(
    waiter: tuple[Claim, Store],
    holder: Store,
    proxy: StallingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(waiting, "_STUCK_AFTER", 0.0)  # cut once a waiter finds it late
    claim, waiting_store = waiter
    _listening(waiting_store)
    listener = waiting_store.listener()
    assert listener is not None
    before = listener.mark()
    op = holder.claim(new("cut"), owner="holder", lease=LEASE).operation
    with ThreadPoolExecutor(1) as pool:
        waited = pool.submit(claim, new("cut"), timedelta(seconds=60))
        assert listener.wait_for_waiters(1, timeout=30)
        proxy.stall("client")  # the listener's read for the waiter hangs
        holder.transition(op, State.SUCCEEDED, kind="provider_answer", actor="holder")
        result = waited.result(timeout=90)
    assert proxy.stalled.is_set()
    assert (result.operation.state, result.replayed) == (State.SUCCEEDED, True)
    proxy.release()
    # The cut connection failed its read; the listener connected and listened again.
    deadline = time.monotonic() + 60
    while (mark := listener.mark()) is None or before is None or mark[0] == before[0]:
        assert time.monotonic() < deadline, "the listener did not listen again"
        threading.Event().wait(0.05)  # paces the polling of its state
    assert mark[0] > before[0]
