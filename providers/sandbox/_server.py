"""The sandbox acquirer's HTTP server on loopback, and ``serve`` for the CLI.

:class:`SandboxServer` owns the life cycle and the controls tests use (clock, faults, ledger,
webhooks); :mod:`payorch.providers.sandbox._api` decides the answers. The server is a stdlib
``ThreadingHTTPServer`` so that faults can act on the socket itself (hold, RST).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import math
import secrets
import socket
import socketserver
import struct
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook

from ._api import Acquirer, CommitGate, error_reply
from ._faults import Fault, FaultPlan
from ._ledger import Clock, EffectStatus
from ._webhooks import MAX_DELAY, Outbox, WebhookDelivery, check_target, generate_secret

__all__ = ["MAX_REQUEST_WAIT", "MAX_SPAN", "MAX_WEBHOOK_DELAY", "SandboxServer"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
REQUEST_LOG_LIMIT = 10_000  # requests kept by SandboxServer.requests()
SHUTDOWN_GRACE = 2.0  # seconds stop() waits for connection threads
# How often "processing" effects are settled when nothing reads them: with a webhook target
# their event must go out on time, not at the next status query.
SETTLE_TICK = 0.1  # seconds
# The longest each setting may be, in seconds. A request waits its latency and jitter, a
# dropped or trickled answer its hold and pauses: an hour each is already "never" to a
# client. Windows and lags are clock arithmetic only: the CLI's 100-year bound.
MAX_REQUEST_WAIT = 3600.0
MAX_WEBHOOK_DELAY = MAX_DELAY
MAX_SPAN = 100 * 365 * 86400.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _seconds(value: timedelta | float, name: str, limit: float = MAX_SPAN) -> float:
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a finite, non-negative duration")
    if seconds > limit:
        raise ValueError(f"{name} must be at most {limit:g} seconds")
    return seconds


class SandboxServer:
    """An acquirer on loopback. ``with SandboxServer() as sb:`` serves on ``sb.url``."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        idempotency_window: timedelta = timedelta(hours=24),
        status_lag: timedelta = timedelta(0),
        settle_after: timedelta = timedelta(seconds=10),
        webhook_secret: str | None = None,
        webhook_url: str | Sequence[str] | None = None,
        webhook_delay: timedelta | float = 0.0,
        fault_rates: Mapping[str, float] | None = None,
        seed: int = 0,
        retry_after: str = "1",
        drop_hold_seconds: float = 30.0,
        trickle_interval: float = 0.05,
        latency: timedelta | float = 0.0,
        jitter: timedelta | float = 0.0,
    ) -> None:
        """``webhook_url``: one or more targets each event is posted to, ``webhook_delay``
        after it happened; ``{tenant}`` in a target is the effect's tenant. ``latency`` and
        ``jitter``: every API request waits ``latency`` plus a uniform draw up to ``jitter``
        (seeded) before it is handled. ValueError for a setting out of range: latency,
        jitter, drop hold and trickle interval at most ``MAX_REQUEST_WAIT``, the webhook
        delay at most ``MAX_WEBHOOK_DELAY``, the rest at most ``MAX_SPAN`` seconds; a target
        that is not a loopback http(s) URL with a valid port. docs/sandbox.md describes
        every setting."""
        if not _is_loopback(host):
            raise ValueError(f"the sandbox only listens on loopback, not {host!r}")
        targets = (webhook_url,) if isinstance(webhook_url, str) else tuple(webhook_url or ())
        for target in targets:
            if not _is_loopback(check_target(target)):
                raise ValueError(f"the sandbox only delivers webhooks to loopback URLs: {target}")
        if not 0 <= port <= 65535:
            raise ValueError(f"invalid port {port}")
        if not retry_after or any(c in retry_after for c in "\r\n"):
            raise ValueError("retry_after must be a non-empty header value")
        self._host = "127.0.0.1" if host == "localhost" else host
        self._port = port
        self._stop = threading.Event()
        self._secret = webhook_secret if webhook_secret is not None else generate_secret()
        clock = Clock()
        try:
            Webhook(self._secret)
        except (ValueError, EmptyWebhookSecretError) as exc:  # ValueError: not base64
            raise ValueError("webhook_secret must be non-empty base64, optionally whsec_") from exc
        outbox = Outbox(
            secret=self._secret,
            clock=clock,
            url=targets,
            stop=self._stop,
            delay=_seconds(webhook_delay, "webhook_delay", MAX_WEBHOOK_DELAY),
        )
        # Kept as given, for describe(): what the server was started with.
        self._settings = {
            "idempotency window": _seconds(idempotency_window, "idempotency_window"),
            "status lag": _seconds(status_lag, "status_lag"),
            "settle after": _seconds(settle_after, "settle_after"),
            "drop hold": _seconds(drop_hold_seconds, "drop_hold_seconds", MAX_REQUEST_WAIT),
            "trickle interval": _seconds(trickle_interval, "trickle_interval", MAX_REQUEST_WAIT),
        }
        self._retry_after = retry_after
        self._acquirer = Acquirer(
            clock=clock,
            faults=FaultPlan(
                fault_rates,
                seed=seed,
                latency=_seconds(latency, "latency", MAX_REQUEST_WAIT),
                jitter=_seconds(jitter, "jitter", MAX_REQUEST_WAIT),
            ),
            outbox=outbox,
            window=self._settings["idempotency window"],
            lag=self._settings["status lag"],
            settle_after=self._settings["settle after"],
            retry_after=retry_after,
            drop_hold=self._settings["drop hold"],
            stop=self._stop,
            trickle_interval=self._settings["trickle interval"],
        )
        self._state = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._settler: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------

    def __enter__(self) -> SandboxServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        with self._state:
            if self._httpd is not None or self._stop.is_set():
                raise RuntimeError("a SandboxServer starts once")
            self._httpd = _HTTPServer((self._host, self._port), self._acquirer)
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},  # bounds how long stop() waits for the loop
                name="sandbox-http",
                daemon=True,
            )
            self._thread.start()
            self._acquirer.outbox.start()
            if self._acquirer.outbox.urls:
                self._settler = threading.Thread(
                    target=self._settle_loop, name="sandbox-settle", daemon=True
                )
                self._settler.start()

    def _settle_loop(self) -> None:
        while not self._stop.wait(SETTLE_TICK):  # bounded by stop()
            self._acquirer.ledger.settle_due()

    def stop(self) -> None:
        """Stop serving and close every connection, held ones included; idempotent."""
        with self._state:
            already = self._stop.is_set()
            self._stop.set()  # wakes latency waits and held responses
            httpd, thread = self._httpd, self._thread
        if already or httpd is None:
            return
        self._acquirer.release_gate()
        httpd.shutdown()
        httpd.abort_connections(SHUTDOWN_GRACE)
        httpd.server_close()
        if thread is not None:
            thread.join(SHUTDOWN_GRACE)
        if self._settler is not None:
            self._settler.join(SHUTDOWN_GRACE)
        self._acquirer.outbox.stop(SHUTDOWN_GRACE)

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the sandbox is not started")
        port = self._httpd.server_address[1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{port}"

    # -- controls for tests and the demo ---------------------------------------------------

    @property
    def webhook_secret(self) -> str:
        return self._secret

    @property
    def webhook_failures(self) -> int:
        """Deliveries to ``webhook_url`` that failed every attempt."""
        return self._acquirer.outbox.failed

    @property
    def webhooks_sent(self) -> int:
        return self._acquirer.outbox.sent

    def advance(self, seconds: float | timedelta) -> None:
        """Move the server clock forward (idempotency window, status lag, settling)."""
        self._acquirer.clock.advance(_seconds(seconds, "seconds", math.inf))
        self._acquirer.ledger.settle_due()

    def inject(self, fault: Fault | str, times: int = 1) -> None:
        """Queue ``fault`` for the next ``times`` POST /v1/operations requests."""
        self._acquirer.faults.inject(fault, times)

    def queued_faults(self) -> list[Fault]:
        """The one-shot faults still waiting for a POST, next first."""
        return self._acquirer.faults.queued()

    def fault_rates(self) -> dict[Fault, float]:
        return self._acquirer.faults.rates()

    def flush_webhooks(self) -> int:
        """Post every event made so far now, delay or not; how many were waiting."""
        return self._acquirer.outbox.flush()

    def webhook_stats(self) -> dict[str, int]:
        """Events made, posts accepted and failed, events waiting to be posted."""
        return self._acquirer.outbox.stats()

    def describe(self) -> list[str]:
        """What the server listens on and does, one line each (what ``serve`` prints)."""
        return _describe(self, self._acquirer, self._settings, self._retry_after)

    def fault_log(self) -> list[Fault | None]:
        """The fault each POST /v1/operations got (None: none), in arrival order."""
        return self._acquirer.faults.log()

    def settle(self, effect_id: str, outcome: str = "succeeded") -> dict[str, Any]:
        """Finish a "processing" effect now, as ``succeeded`` or ``declined``."""
        return self._acquirer.ledger.settle(effect_id, EffectStatus(outcome))

    def overturn(self, effect_id: str) -> dict[str, Any]:
        """Approve a declined effect after all (a late stand-in approval): succeeded now."""
        return self._acquirer.ledger.overturn(effect_id)

    def ledger(self) -> list[dict[str, Any]]:
        """Every entry, status lag ignored."""
        return self._acquirer.ledger.entries()

    def settlement_report(
        self,
        *,
        format: str = "stripe",
        batch: str | int = 1,
        fee: Callable[[int], int] | None = None,
        effects: Collection[str] | None = None,
    ) -> bytes:
        """The ledger's money movements as one batch of a settlement report, in Stripe's
        itemized format or Adyen's Settlement details format (``fee``: per captured amount;
        ``effects``: only these ids), for ``payorch recon import --provider sandbox``."""
        from ._report import settlement_report  # the report formats: only when asked

        return settlement_report(
            self.ledger(), format=format, batch=batch, fee=fee, effects=effects
        )

    def effects_for(self, key: str) -> list[dict[str, Any]]:
        """Effects made under ``key``: a downstream key (or a namespace ref) as payorch sent
        it, or, for effects made before keys came from the namespace, an operation id."""
        return [
            e
            for e in self.ledger()
            if key in (e["idempotency_key"], e["metadata"].get("payorch_ref"))
            or e["metadata"].get("operation_id") == key
        ]

    def requests(self) -> list[dict[str, Any]]:
        """The requests received, oldest first (bounded): method, path, headers (lower-case
        names), ``body`` (bytes) and ``peer``, the client's ``host:port`` (which connection
        carried it), e.g. to see the ``traceparent`` a client sent."""
        httpd = self._httpd
        if httpd is None:
            return []
        with httpd.received_lock:
            return [dict(r) for r in httpd.received]

    def webhook_deliveries(self) -> list[WebhookDelivery]:
        self._acquirer.ledger.settle_due()  # a read: due settlements emit their events first
        return self._acquirer.outbox.deliveries()

    @contextlib.contextmanager
    def hold_commits(self) -> Iterator[CommitGate]:
        """Hold new POSTs between claiming their key and committing, until released."""
        with self._acquirer.hold_commits() as gate:
            yield gate


class _HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that tracks its connections so stop() can cut them."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog; the default 5 resets bursts of connects

    def __init__(self, address: tuple[str, int], acquirer: Acquirer) -> None:
        self.acquirer = acquirer
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._reset: set[socket.socket] = set()
        self.received: deque[dict[str, Any]] = deque(maxlen=REQUEST_LOG_LIMIT)
        self.received_lock = threading.Lock()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a reverse DNS look-up that can hang
        # on a machine without a resolver; loopback needs no name.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_connection,
            args=(request, client_address),
            name="sandbox-conn",
            daemon=True,
        )
        with self._lock:
            self._connections[request] = thread
        thread.start()

    def _serve_connection(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - one broken connection must not stop the server
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._lock:
                self._connections.pop(request, None)

    def reset_on_close(self, request: socket.socket) -> None:
        with self._lock:
            self._reset.add(request)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            reset = request in self._reset
            self._reset.discard(request)
        if reset:
            # SO_LINGER (on, 0 s): close() sends RST instead of FIN, and no shutdown(SHUT_WR)
            # first, which would send a FIN the client reads as a clean end of stream.
            with contextlib.suppress(OSError):
                request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_request(request)
            return
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("sandbox connection from %s failed", client_address, exc_info=True)

    def abort_connections(self, timeout: float) -> None:
        """Cut every open connection (idle keep-alives, held responses) and join threads."""
        with self._lock:
            connections = list(self._connections.items())
        for request, _ in connections:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)  # unblocks a thread reading the socket
        for _, thread in connections:
            thread.join(timeout / max(1, len(connections)))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real acquirer
    server_version = "payorch-sandbox/1"
    sys_version = ""
    timeout = 300  # seconds; an idle keep-alive connection does not hold a thread forever

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes; without this, Nagle plus the client's
        # delayed ACK stall every response by ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    do_PUT = do_PATCH = do_DELETE = do_POST

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - " + format, self.address_string(), *args)

    def _dispatch(self) -> None:
        httpd = cast(_HTTPServer, self.server)
        acquirer = httpd.acquirer
        body = self._read_body()
        if body is None:
            self.close_connection = True  # the unread body would be parsed as a request
            reply = error_reply(413, "invalid_request_error", "body_too_large")
        else:
            headers = {k.lower(): v for k, v in self.headers.items()}
            with httpd.received_lock:
                httpd.received.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": headers,
                        "peer": f"{self.client_address[0]}:{self.client_address[1]}",
                        "body": body,  # bytes, as received (what a retry must repeat)
                    }
                )
            try:
                reply = acquirer.handle(self.command, self.path, headers, body)
            except Exception:  # answer 500 like a real API and keep serving
                log.exception("sandbox request failed")
                reply = error_reply(500, "api_error")
        if acquirer.stopping:
            self.close_connection = True
        if reply.wire is Fault.DROP_AFTER:
            self.close_connection = True
            acquirer.hold_response()  # the client's read time-out fires; stop() ends it
            return
        if reply.wire is Fault.RESET_AFTER:
            self.close_connection = True
            httpd.reset_on_close(self.connection)
            return
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply.body)))
            self.send_header("Request-Id", f"req_{secrets.token_hex(8)}")
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            if reply.wire is Fault.TRICKLE:
                self._trickle(reply.body, acquirer)
            else:
                self.wfile.write(reply.body)
        except OSError:
            self.close_connection = True  # the client went away; nothing to tell it

    def _trickle(self, body: bytes, acquirer: Acquirer) -> None:
        """Send ``body`` one byte per trickle interval; a client that gives up ends it."""
        self.close_connection = True  # a cut-short body leaves the connection unusable
        self.wfile.flush()  # the headers go out at once
        for i in range(len(body)):
            if i and acquirer.trickle_pause():
                return  # stopping: the body stays incomplete
            self.wfile.write(body[i : i + 1])
            self.wfile.flush()

    def _read_body(self) -> bytes | None:
        """The request body, b"" if none; None if too large or unreadable."""
        length_header = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") is not None:
            return None  # chunked uploads are not supported; refuse rather than misparse
        if length_header is None:
            return b""
        try:
            length = int(length_header)
        except ValueError:
            return None
        if not 0 <= length <= MAX_BODY_BYTES:
            return None
        return self.rfile.read(length)


def _span(seconds: float) -> str:
    """A duration as the CLI takes it: 0s, 250ms, 1.5s, 10s, 2m, 24h."""
    if seconds == 0:
        return "0s"
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    if seconds < 1 and (seconds * 1000).is_integer():
        return f"{int(seconds * 1000)}ms"
    return f"{seconds:g}s"


def _describe(
    sandbox: SandboxServer,
    acquirer: Acquirer,
    settings: Mapping[str, float],
    retry_after: str,
) -> list[str]:
    plan = acquirer.faults
    rates = ", ".join(f"{f.value}={r:g}" for f, r in plan.rates().items())
    queued = plan.queued()
    # In the order they will apply: runs of one fault as "kind xN".
    nexts = ", ".join(f"{f.value} x{len(list(run))}" for f, run in itertools.groupby(queued))
    fixed, jitter = plan.base_latency
    outbox = acquirer.outbox
    if outbox.urls:
        after = f" {_span(outbox.delay)} after each event" if outbox.delay else " at once"
        hooks = f"posted{after} to {', '.join(outbox.urls)}"
    else:
        hooks = "kept, not posted (no --webhook-url)"
    latency = (
        "none"
        if not (fixed or jitter)
        else _span(fixed) + (f" + up to {_span(jitter)} jitter" if jitter else "")
    )
    timing = ", ".join(f"{name} {_span(value)}" for name, value in settings.items())
    return [
        f"sandbox acquirer listening on {sandbox.url}",
        f"webhook secret: {sandbox.webhook_secret}",
        f"webhooks: {hooks}",
        f"fault rates: {rates or 'none'}",
        f"next faults: {nexts or 'none'}",
        f"latency: {latency}",
        f"{timing}, retry-after {retry_after}s",
        "press Ctrl-C to stop",
    ]
