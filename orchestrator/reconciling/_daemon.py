"""``payorch reconcile run``: the reconciler on an APScheduler interval.

One job, ``max_instances=1`` and ``coalesce=True``: passes never overlap and missed ones
collapse into one. A job drains: it runs passes back to back until one picks nothing (or
the stop flag is set), then the interval begins. Within a pass, the next batch is leased
while the last checks of the previous one run (for up to one interval), so the checks
never wait for a batch to finish. SIGTERM/SIGINT set a stop flag: the
checks in flight finish, the rest of the batch is handed back (leases released), and the
process exits.

Opt-in, a second job (same defaults) looks for provider effects no operation explains
(:class:`~payorch.reconciling._watch.UnexplainedWatch`, ``PAYORCH_UNEXPLAINED_EVERY_SECONDS``);
with sinks configured (``PAYORCH_OUTBOX_SINKS``), a third drains the outbox
(:class:`payorch.outbox.Relay`) every ``PAYORCH_OUTBOX_INTERVAL_SECONDS``.

With a monitoring address the daemon also serves, on a small threaded HTTP server:
``/metrics`` (Prometheus text format; 404 without the ``payorch[metrics]`` extra),
``/healthz`` (200 while the process runs) and ``/readyz`` (200 when the database answers
as a read-write primary, a pass finished within ``3 x interval`` and, if the store requires
a synchronous standby, one streams; else 503 with the reason on one line). Either way the
body names the replication mode (:mod:`payorch.storage._replication`). At start-up the daemon logs
that mode and what it means (WARNING when it puts commits at risk) and, in strict mode,
refuses to start without a synchronous standby.

Before all of that it checks the schema (``Store.check_schema()``): a database without
payorch's tables, or at an older revision, refuses the start with
:class:`~payorch.errors.SchemaNotReady`, whose message names ``payorch db upgrade``; nothing
is bound, scheduled or logged as started. Should the schema go missing while it runs (a
restore, a dropped table), ``/readyz`` answers 503 with the same hint.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from apscheduler.schedulers.background import BackgroundScheduler

from ..errors import ConfigurationError, SchemaNotReady, StorageError
from ..observing import _metrics as metrics
from ..observing._bounded import OneAtATime
from ..storage._probes import replication
from ..storage._replication import ENV_STRICT, Status
from ._reconciler import Reconciler, ReconcileReport

if TYPE_CHECKING:
    from ..storage._store import Store
    from ._fallback_watch import FallbackWatch
    from ._watch import UnexplainedWatch

__all__ = ["Drains", "MonitorServer", "ReconcilerDaemon", "parse_address"]


class Drains(Protocol):
    """What the daemon's outbox job runs (a :class:`payorch.outbox.Relay`)."""

    def drain(self, stop: threading.Event | None = None) -> Any: ...


STALE_PASSES = 3  # /readyz fails when no pass finished within this many intervals

log = logging.getLogger("payorch.reconciler")


class ReconcilerDaemon:
    def __init__(
        self,
        reconciler: Reconciler,
        *,
        interval: timedelta = timedelta(seconds=5),
        on_report: Callable[[ReconcileReport], None] | None = None,
        monitor: tuple[str, int] | None = None,
        unexplained: UnexplainedWatch | None = None,
        relay: Drains | None = None,
        relay_interval: timedelta = timedelta(seconds=2),
        fallbacks: FallbackWatch | None = None,
    ) -> None:
        if interval <= timedelta(0):
            raise ValueError("interval must be positive")
        self.reconciler = reconciler
        self.interval = interval
        self.stop_event = threading.Event()
        self.passes = 0
        self.total = ReconcileReport()
        self._on_report = on_report
        self._monitor_address = monitor
        self.unexplained = unexplained  # the opt-in look for effects no operation explains
        if unexplained is not None and unexplained.tenant_ids is None:
            # A sharded reconciler's look judges and adopts only its own tenants' effects.
            unexplained.tenant_ids = reconciler.tenant_ids
        self.relay, self.relay_interval = relay, relay_interval  # the outbox, if configured
        # The look at the providers routed operations moved away from (payorch.routing).
        self.fallbacks = fallbacks
        if fallbacks is not None and fallbacks.tenant_ids is None:
            fallbacks.tenant_ids = reconciler.tenant_ids
        self.monitor: MonitorServer | None = None
        self.started_at = time.monotonic()
        self.last_pass_at: float | None = None  # monotonic end of the last successful pass
        # SchemaNotReady's message from the last pass that met it (None: the schema served).
        self.schema_problem: str | None = None
        self._scheduler = BackgroundScheduler(
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None}
        )

    def _pass(self) -> None:
        """Passes back to back while work is due; the interval starts once one finds nothing."""
        while not self.stop_event.is_set():
            report = self._one_pass()
            if report is None or report.picked == 0:
                return

    def _one_pass(self) -> ReconcileReport | None:
        try:
            # A pass keeps its checks busy for up to one interval, then reports.
            report = self.reconciler.reconcile_once(
                stop=self.stop_event, refill_for=self.interval.total_seconds()
            )
        except StorageError as exc:  # the database is away: one line, the next pass retries
            if isinstance(exc, SchemaNotReady):  # readiness says so until a pass succeeds
                self.schema_problem = exc.message
            log.warning("reconcile pass skipped: %s", " ".join(exc.message.split()))
            metrics.pass_finished("skipped")
            return None
        except Exception:  # a bad pass must not kill the daemon; the next one retries
            log.exception("reconcile pass failed")
            metrics.pass_finished("failed")
            return None
        self.last_pass_at = time.monotonic()
        self.schema_problem = None
        metrics.pass_finished("ok")
        self.passes += 1
        self.total.merge(report)
        if self._on_report is not None:
            self._on_report(report)
        return report

    def _look_for_unexplained(self) -> None:
        assert self.unexplained is not None
        try:
            self.unexplained.run()
        except Exception:  # a bad look must not kill the daemon; the next one retries
            log.exception("look for unexplained effects failed")

    def _look_at_fallbacks(self) -> None:
        assert self.fallbacks is not None
        try:
            self.fallbacks.run()
        except Exception:  # a bad look must not kill the daemon; the next one retries
            log.exception("look at routed operations' earlier providers failed")

    def _relay_outbox(self) -> None:
        assert self.relay is not None
        try:
            self.relay.drain(stop=self.stop_event)
        except StorageError as exc:  # the database is away: the next tick retries
            log.warning("outbox pass skipped: %s", " ".join(exc.message.split()))
        except Exception:  # a bad pass must not kill the daemon; the next one retries
            log.exception("outbox pass failed")

    def readiness(self) -> str | None:
        """Why the daemon is not ready (``None``: ready): the database must answer as a
        read-write primary (with a synchronous standby streaming, in strict mode) and a pass
        must have finished within ``STALE_PASSES`` intervals (since start-up, at first)."""
        return self._readiness()[0]

    def _readiness(self) -> tuple[str | None, Status | None]:
        since = time.monotonic() - (self.last_pass_at or self.started_at)
        limit = STALE_PASSES * self.interval.total_seconds()
        status = None
        if self.monitor is not None:
            status = self.monitor.replication()
            problem = self._database_problem(status)
            if problem is not None:
                return problem, status
        elif self.schema_problem is not None:
            return self.schema_problem, None
        if since > limit:
            return f"no reconcile pass finished for {since:.1f}s (limit {limit:g}s)", status
        return None, status

    def _database_problem(self, status: Status | None) -> str | None:
        """What the monitor's probes say keeps the database from serving (None: nothing)."""
        assert self.monitor is not None
        if status is None:
            return "database unreachable"
        if status.mode == "read_only":
            return "the database is a standby or a read-only session"
        reason = status.refusal() if self.reconciler.store.replication.strict else None
        if reason is not None:
            return f"{ENV_STRICT} is set and {reason}"
        return self.monitor.schema()

    def start(self, on_start: Callable[[], None] | None = None) -> None:
        """Check the schema, bind the monitor (if any), check the replication mode, call
        ``on_start``, then schedule the passes. ``SchemaNotReady``, a strict-mode refusal or
        a ``ConfigurationError`` (a taken address) stops start-up before ``on_start``."""
        # One read: a database never migrated, or migrated by an older payorch, is refused
        # with the command to run instead of failing every pass.
        self.reconciler.store.check_schema()
        if self._monitor_address is not None and self.monitor is None:
            # Bound before on_start: a taken or invalid address stops start-up before any
            # pass runs, and before anything says "started".
            self.monitor = MonitorServer(self, self._monitor_address)
            self.monitor.start()
        try:
            # The replication mode, logged; in strict mode no start without a sync standby.
            self.reconciler.store.replication.check()
        except BaseException:
            if self.monitor is not None:  # a refused start leaves no port behind
                self.monitor.stop()
                self.monitor = None
            raise
        if on_start is not None:
            on_start()
        self.started_at = time.monotonic()
        self._scheduler.add_job(
            self._pass,
            "interval",
            seconds=self.interval.total_seconds(),
            id="reconcile",
            next_run_time=None,
        )
        if self.unexplained is not None:
            self._scheduler.add_job(
                self._look_for_unexplained,
                "interval",
                seconds=self.unexplained.every.total_seconds(),
                id="unexplained",
            )
        if self.fallbacks is not None:
            self._scheduler.add_job(
                self._look_at_fallbacks,
                "interval",
                seconds=self.fallbacks.every.total_seconds(),
                id="fallbacks",
            )
        if self.relay is not None:
            self._scheduler.add_job(
                self._relay_outbox,
                "interval",
                seconds=self.relay_interval.total_seconds(),
                id="outbox",
                next_run_time=datetime.now(UTC),
            )
        self._scheduler.start()
        self._scheduler.modify_job("reconcile", next_run_time=datetime.now(UTC))

    def stop(self) -> None:
        """Finish the pass in flight, release unprocessed leases, stop the scheduler."""
        self.stop_event.set()
        if self._scheduler.running:
            self._scheduler.shutdown(wait=True)
        if self.monitor is not None:
            self.monitor.stop()

    def run(
        self,
        *,
        install_signal_handlers: bool = True,
        on_start: Callable[[], None] | None = None,
    ) -> ReconcileReport:
        """Block until SIGTERM/SIGINT (or :meth:`stop` from another thread).

        ``on_start`` runs once the monitor is bound, before the first pass."""
        if install_signal_handlers:

            def _handler(signum: int, _frame: FrameType | None) -> None:
                log.info("signal %s: finishing the current batch", signum)
                self.stop_event.set()

            signal.signal(signal.SIGTERM, _handler)
            signal.signal(signal.SIGINT, _handler)
        self.start(on_start)
        try:
            self.stop_event.wait()
        finally:
            self.stop()
        return self.total


def parse_address(text: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` for IPv6; port 0 picks a free one), or ``off``: ``None``.

    Raises ``ConfigurationError`` (one line) for anything else.
    """
    value = text.strip()
    if value.lower() in {"off", "none", "disabled", ""}:
        return None
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            host = ""  # brackets are for IPv6 only
    elif ":" in host:
        host = ""  # an IPv6 address needs brackets to be told from its port
    try:
        port = int(port_text) if port_text.isdigit() else -1
        if host and ":" in host:
            ip_address(host)
    except ValueError:
        port = -1
    if not sep or not host or not 0 <= port <= 65535:
        raise ConfigurationError(
            f"metrics address {text!r} is not host:port (e.g. 127.0.0.1:9464), [v6]:port or off"
        )
    return host, port


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # SO_REUSEADDR (http.server's default) lets a restart bind past TIME_WAIT; on Linux it
    # never lets two listeners share a port, so a taken port still fails.


class _Server6(_Server):
    address_family = socket.AF_INET6


class MonitorServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` for a :class:`ReconcilerDaemon`."""

    def __init__(
        self, daemon: ReconcilerDaemon, address: tuple[str, int], *, timeout: float = 5.0
    ) -> None:
        self.daemon = daemon
        store = daemon.reconciler.store
        metrics.watch(store, timeout=timeout)
        # One round trip: the database answers, and how it is replicated.
        self._replication = OneAtATime(lambda: replication(store), timeout=timeout)
        self._schema = OneAtATime(lambda: _schema_problem(store), timeout=timeout)
        host, port = address
        try:
            server = _Server6 if ":" in host else _Server
            self._server = server((host, port), _handler(self))
        except (OSError, OverflowError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigurationError(
                f"cannot serve metrics on {host}:{port}: {reason} (set PAYORCH_METRICS_ADDR, "
                "or off)"
            ) from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="payorch-monitor", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def database_answers(self) -> bool:
        return self._replication() is not None

    def replication(self) -> Status | None:
        """The replication status (``read_only`` for a standby); None: no answer in time."""
        return self._replication()

    def schema(self) -> str | None:
        """Why the schema cannot serve (``SchemaNotReady``'s message, naming the command to
        run); None when it can, or when the database gave no answer in time."""
        return self._schema() or None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def _schema_problem(store: Store) -> str:
    """``""`` while the schema is this install's; else what ``check_schema`` refused with.
    Other failures propagate: the replication probe already reports an unreachable database."""
    try:
        store.check_schema()
    except SchemaNotReady as exc:
        return " ".join(exc.message.split())
    return ""


def _handler(monitor: MonitorServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "payorch"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                exposed = metrics.exposition()
                if exposed is None:
                    self._reply(404, b"metrics need the payorch[metrics] extra\n")
                else:
                    self._reply(200, *exposed)
            elif path == "/healthz":
                self._reply(200, b"ok\n")
            elif path == "/readyz":
                problem, status = monitor.daemon._readiness()
                mode = f"; replication {status.describe()}" if status is not None else ""
                if problem is None:
                    self._reply(200, f"ready{mode}\n".encode())
                else:
                    self._reply(503, f"not ready: {problem}{mode}\n".encode())
            else:
                self._reply(404, b"not found: /metrics, /healthz, /readyz\n")

        def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("monitor: " + format, *args)

    return Handler
