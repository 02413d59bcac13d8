"""An adapter's HTTP calls: its httpx clients, and the total deadline of each call.

**Clients** (:class:`HttpClients`): the caller's, or built from the adapter's settings. A
client or transport the caller passes stays the caller's: used, never closed or renewed. A
client built here is closed by :meth:`HttpClients.close` / :meth:`HttpClients.aclose`, and
dropped in a forked child (its keep-alive connections are the parent's: two processes on one
connection read each other's responses), to be built again on the child's first call. The
async client is built on first async use, so a sync-only user never opens one.

**Deadline** (:func:`send_with_deadline`): httpx's time-outs apply per socket operation (each
connect, write, read), so a response trickled one byte per read time-out never times out.
Here the call runs on a worker thread and the caller waits for it until the deadline, which
bounds the call whatever the provider does. Whether the request may have been sent by then is
decided once, under a lock, from httpcore's phase announcements (the ``trace`` request
extension). :func:`asend_with_deadline` is the async twin: ``asyncio.timeout`` bounds the
whole call, and the same announcements say whether writing had begun when it was cancelled.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any, Self

import httpx

from .forks import reset_in_child

__all__ = [
    "RAW_EVIDENCE_LIMIT",
    "ClosesClients",
    "DeadlineExceeded",
    "HttpClients",
    "ProviderReply",
    "asend_with_deadline",
    "bounded_raw",
    "call_budget",
    "parse_retry_after",
    "send_with_deadline",
    "unix_time",
]

RAW_EVIDENCE_LIMIT = 4096  # bytes of a raw provider body kept as evidence


_SLACK = 0.01  # a capped time-out that fires this close to the deadline is the deadline's


class DeadlineExceeded(httpx.TimeoutException):
    """The whole call outlived its deadline; ``possibly_sent``: writing may have begun."""

    code = "deadline_exceeded"

    def __init__(self, message: str, *, possibly_sent: bool, request: httpx.Request) -> None:
        super().__init__(message, request=request)
        self.possibly_sent = possibly_sent


# The request's first byte is written in this phase (HTTP/1.1 and HTTP/2 alike).
_WRITE_PHASES = frozenset({"send_request_headers"})
_WORK_PHASES = _WRITE_PHASES | {
    "connect_tcp",
    "connect_unix_socket",
    "start_tls",
    "send_connection_init",  # the HTTP/2 preface: bytes on the wire, none of the request
    "send_request_body",
    "receive_response_headers",
    "receive_response_body",
}


class _Call:
    """One request run on a worker thread, and what its caller may conclude at the deadline.

    ``writing`` turns True, under ``lock``, just before the first byte of the request is
    written; once the caller has given up (``abandoned``) the worker never starts writing.
    So "not written" is decided once, by whichever side takes the lock first.
    """

    def __init__(self, client: httpx.Client, request: httpx.Request, deadline: float) -> None:
        self.client = client
        self.request = request
        self.deadline = deadline
        self.lock = threading.Lock()
        # Held until the worker has its result: the caller waits by acquiring it (a bare
        # lock: an Event's condition costs more than the wait it stands for).
        self.done = threading.Lock()
        self.done.acquire()
        self.finished = False
        self.abandoned = False
        self.writing = False
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.traced = _traces_phases(client, request)
        configured = request.extensions.get("timeout") or {}
        self.configured: dict[str, float | None] = dict(configured)
        # httpcore reads this dict at the start of each phase; trace() keeps it capped to
        # what is left, so an abandoned worker also gives up soon.
        self.timeouts: dict[str, float | None] = dict(self.configured)
        request.extensions = {**request.extensions, "timeout": self.timeouts, "trace": self.trace}

    def expired(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            "the provider call outlived its deadline",
            possibly_sent=self.writing,
            request=self.request,
        )

    def checkpoint(self, *, starts_writing: bool = False) -> None:
        """Between two steps of the worker: stop if the deadline passed; note writing."""
        with self.lock:
            remaining = self.deadline - time.monotonic()
            if self.abandoned or remaining <= 0:
                self.abandoned = True
                raise self.expired()
            self.writing = self.writing or starts_writing
        for phase, limit in self.configured.items():
            self.timeouts[phase] = remaining if limit is None else min(limit, remaining)

    def trace(self, event: str, info: Mapping[str, Any]) -> None:
        # httpcore announces each phase ("http11.send_request_headers.started", …). Only
        # phases that start work may stop the worker: raising while a response closes would
        # keep its connection out of the pool.
        *_, phase, stage = event.split(".")
        if stage == "started" and phase in _WORK_PHASES:
            self.checkpoint(starts_writing=phase in _WRITE_PHASES)

    def run(self) -> None:
        try:
            # A transport that does not announce its phases may write at once: from here on
            # the request counts as possibly sent.
            self.checkpoint(starts_writing=not self.traced)
            response = self.client.send(self.request, stream=True)
            try:
                if not isinstance(response.stream, httpx.SyncByteStream):
                    raise TypeError("an httpx.Client answered with an async stream")
                response.stream = _CheckedStream(response.stream, self.checkpoint)
                response.read()
            finally:
                response.close()
            result: tuple[httpx.Response | None, BaseException | None] = (response, None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
            result = (None, exc)
        with self.lock:  # with the result, under the lock give_up() takes
            self.response, self.error = result
            self.finished = True
        self.done.release()

    def give_up(self) -> DeadlineExceeded | None:
        """At the deadline: the exception to raise, or None if the worker just finished."""
        with self.lock:
            if self.finished:
                return None
            self.abandoned = True
            return self.expired()


class _CheckedStream(httpx.SyncByteStream):
    """A response body that stops at the deadline between two chunks."""

    def __init__(self, inner: httpx.SyncByteStream, check: Callable[[], None]) -> None:
        self._inner = inner
        self._check = check

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._check()
            yield chunk

    def close(self) -> None:
        self._inner.close()


def _traces_phases(client: httpx.Client | httpx.AsyncClient, request: httpx.Request) -> bool:
    """Whether ``request`` goes through httpcore, which announces each phase to ``trace``."""
    try:
        transport = client._transport_for_url(request.url)  # the mount httpx itself would use
    except Exception:  # noqa: BLE001 - an unknown client: assume nothing is announced
        return False
    return isinstance(transport, httpx.HTTPTransport | httpx.AsyncHTTPTransport)


class _Workers:
    """Daemon threads for provider calls, kept idle for the next call.

    Starting a thread per call cost more CPU than a loopback call itself. A call never
    waits for a worker: with none idle a new one starts, so a worker held by an abandoned
    call (it stops at its next phase) delays nobody. Idle workers beyond ``keep``, or idle
    for ``idle_for`` seconds, end.
    """

    def __init__(self, keep: int = 64, idle_for: float = 60.0) -> None:
        self._keep = keep
        self._idle_for = idle_for
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            thread = threading.Thread(
                target=_Worker(self).loop, args=(job,), name="payorch-provider-call", daemon=True
            )
            thread.start()
        else:
            worker.give(job)

    def park(self, worker: _Worker) -> Callable[[], None] | None:
        """Wait idle for the next job; None: end the thread."""
        with self._lock:
            if len(self._idle) >= self._keep:
                return None
            self._idle.append(worker)
        if not worker.handed.acquire(timeout=self._idle_for):
            with self._lock:
                if worker in self._idle:
                    self._idle.remove(worker)
                    return None
            worker.handed.acquire()  # taken from the list just now: its job is on the way
        return worker.take()

    def forget(self) -> None:
        """In a forked child: the parent's threads do not exist there."""
        self._lock = threading.Lock()
        self._idle = []


class _Worker:
    def __init__(self, workers: _Workers) -> None:
        self._workers = workers
        # Held while the worker has no job; give() releases it (a bare lock, as above).
        self.handed = threading.Lock()
        self.handed.acquire()
        self._job: Callable[[], None] | None = None

    def give(self, job: Callable[[], None]) -> None:
        self._job = job
        self.handed.release()

    def take(self) -> Callable[[], None] | None:
        job, self._job = self._job, None
        return job

    def loop(self, job: Callable[[], None] | None) -> None:
        while job is not None:
            job()  # _Call.run hands every exception to its caller
            job = self._workers.park(self)


_WORKERS = _Workers()
reset_in_child(_WORKERS, _Workers.forget)


def send_with_deadline(
    client: httpx.Client, request: httpx.Request, *, deadline: float
) -> httpx.Response:
    """Send ``request`` and read its whole body, or raise by ``deadline`` at the latest.

    ``deadline`` is a :func:`time.monotonic` instant. The call runs on a worker thread (kept
    for the next call) and the caller waits for it until the deadline, so the caller's bound
    is the deadline itself whatever the provider does (a body or headers trickled one byte
    per read time-out included). On time, the worker's result is returned, or its
    ``httpx.HTTPError`` raised. Past it :class:`DeadlineExceeded` is raised, with
    ``possibly_sent=False`` only when httpcore had not begun writing the request (waiting
    for a pool slot, connecting, TLS); the abandoned worker then never writes, and stops at
    its next phase or body chunk.
    """
    call = _Call(client, request, deadline)
    _WORKERS.run(call.run)
    if not call.done.acquire(timeout=max(0.0, deadline - time.monotonic())):
        expired = call.give_up()
        if expired is not None:
            raise expired
    if call.response is None:
        error = call.error
        if isinstance(error, httpx.TimeoutException) and time.monotonic() >= deadline - _SLACK:
            # The worker's time-outs were capped to what was left: the deadline ended it,
            # just before the caller's own wait did.
            raise call.expired() from error
        raise error or RuntimeError("the provider call ended without a result")
    return call.response


async def asend_with_deadline(
    client: httpx.AsyncClient, request: httpx.Request, *, deadline: float
) -> httpx.Response:
    """Send ``request`` and read its whole body, or raise by ``deadline`` at the latest.

    The async twin of :func:`send_with_deadline`, with the same contract: ``deadline`` is a
    :func:`time.monotonic` instant; past it :class:`DeadlineExceeded` is raised, with
    ``possibly_sent=False`` only when httpcore had not announced the first write of the
    request. A cancelled task stops at an ``await``, and the announcement is made just
    before the write, so "not written" is exact here too. A transport that announces
    nothing (a mock, a custom transport) is possibly sent from the start.
    """
    writing = not _traces_phases(client, request)

    async def trace(event: str, info: Mapping[str, Any]) -> None:
        nonlocal writing
        *_, phase, stage = event.split(".")
        if stage == "started" and phase in _WRITE_PHASES:
            writing = True

    request.extensions = {**request.extensions, "trace": trace}
    remaining = deadline - time.monotonic()
    if remaining <= 0:  # spent before this call began: nothing was sent
        raise DeadlineExceeded(
            "the provider call outlived its deadline", possibly_sent=False, request=request
        )
    try:
        async with asyncio.timeout(remaining):
            return await client.send(request)  # reads the whole body inside the bound
    except TimeoutError as exc:
        raise DeadlineExceeded(
            "the provider call outlived its deadline", possibly_sent=writing, request=request
        ) from exc


# -- the clients ---------------------------------------------------------------------------


class HttpClients:
    """One adapter's sync and async httpx clients."""

    def __init__(
        self,
        *,
        timeout: httpx.Timeout,
        client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        async_client: httpx.AsyncClient | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._timeout = timeout
        self._owns_sync = client is None
        self._sync: httpx.Client | None = client or httpx.Client(
            timeout=timeout, transport=transport
        )
        self._async = async_client
        self._owns_async = async_client is None
        self._async_transport = async_transport
        # Renewed in a forked child: only what was built from settings alone.
        self._renews_sync = client is None and transport is None
        self._renews_async = async_client is None and async_transport is None
        if self._renews_sync or self._renews_async:
            reset_in_child(self, HttpClients._forget)

    @property
    def sync(self) -> httpx.Client:
        client = self._sync
        if client is None:  # only in a forked child, before its first call
            client = self._sync = httpx.Client(timeout=self._timeout)
        return client

    def asynchronous(self) -> httpx.AsyncClient:
        client = self._async
        if client is None:
            client = self._async = httpx.AsyncClient(
                timeout=self._timeout, transport=self._async_transport
            )
        return client

    def close(self) -> None:
        """Close the sync client if it was built here."""
        if self._owns_sync and self._sync is not None:
            self._sync.close()

    async def aclose(self) -> None:
        """Close both clients built here (the async one on the running loop)."""
        self.close()
        if self._owns_async and self._async is not None:
            await self._async.aclose()
            self._async = None

    def _forget(self) -> None:
        # Dropped, not closed (the parent still uses them); built again on first use, not
        # here: a fork hook must stay quick.
        if self._renews_sync:
            self._sync = None
        if self._renews_async:
            self._async = None


# -- an adapter's own: its replies and the lifecycle of its clients ---------------------


@dataclass(frozen=True, kw_only=True)
class ProviderReply:
    """One HTTP reply from a provider, its body parsed once; an adapter's classifiers
    subclass it with what its provider's headers and error bodies say."""

    status: int
    headers: httpx.Headers
    body: dict[str, Any] | None  # the JSON object, or None if the body is not one
    content: bytes

    @classmethod
    def from_response(cls, response: httpx.Response) -> Self:
        content = response.content
        try:
            parsed = json.loads(content)
        except (ValueError, RecursionError):  # not JSON / not UTF-8 / absurdly nested
            parsed = None
        return cls(
            status=response.status_code,
            headers=response.headers,
            body=parsed if isinstance(parsed, dict) else None,
            content=content,
        )

    def says(self, header: str) -> bool:
        """Whether ``header`` is ``true`` (case and blanks ignored)."""
        return str(self.headers.get(header, "")).strip().lower() == "true"

    @property
    def retry_after(self) -> str | None:
        value = self.headers.get("retry-after")
        return str(value) if value is not None else None


class ClosesClients:
    """``close``/``aclose`` and both context managers, for an adapter whose httpx clients
    are its ``_clients`` (:class:`HttpClients`)."""

    _clients: HttpClients

    def close(self) -> None:
        self._clients.close()

    async def aclose(self) -> None:
        """Close both clients this adapter opened (the async one on its own loop)."""
        await self._clients.aclose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# -- small readings of what a provider sent (re-exported by payorch.provider) ----------


def call_budget(timeout: httpx.Timeout) -> timedelta:
    """Every phase of ``timeout`` added up: the adapters' default call deadline.

    Not a bound by itself (read and write time-outs apply per socket operation); the
    deadline of :func:`send_with_deadline` is.
    """
    phases = (timeout.connect, timeout.write, timeout.read, timeout.pool)
    if any(p is None for p in phases):
        raise ValueError("every httpx time-out phase must be set explicitly")
    return timedelta(seconds=sum(float(p) for p in phases if p is not None))


def unix_time(value: object) -> datetime | None:
    """A provider's Unix timestamp (seconds) as an aware UTC datetime; None when it is not
    one or is out of range (a provider's ``created``: evidence, never trusted blindly)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        return datetime.fromtimestamp(value, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return None


def bounded_raw(text: str | bytes | None) -> str | None:
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text[:RAW_EVIDENCE_LIMIT].decode("utf-8", errors="replace")
    return text[:RAW_EVIDENCE_LIMIT]


def parse_retry_after(value: str | None, default: float = 1.0) -> float:
    """Seconds from a ``Retry-After`` header (RFC 9110: delay-seconds or an HTTP-date);
    ``default`` when it is absent, unreadable or not finite."""
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return default
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else default
