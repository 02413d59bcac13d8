"""``payorch reconcile run``: the reconciler on an APScheduler interval.

One job, ``max_instances=1`` and ``coalesce=True``: passes never overlap and missed ones
collapse into one. SIGTERM/SIGINT set a stop flag: the pass in flight finishes the
operation it is on, hands the rest of its batch back (leases released), and the process
exits.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from types import FrameType

from apscheduler.schedulers.background import BackgroundScheduler

from .errors import StorageError
from .reconciler import Reconciler, ReconcileReport

__all__ = ["ReconcilerDaemon"]

log = logging.getLogger("payorch.reconciler")


class ReconcilerDaemon:
    def __init__(
        self,
        reconciler: Reconciler,
        *,
        interval: timedelta = timedelta(seconds=5),
        on_report: Callable[[ReconcileReport], None] | None = None,
    ) -> None:
        if interval <= timedelta(0):
            raise ValueError("interval must be positive")
        self.reconciler = reconciler
        self.interval = interval
        self.stop_event = threading.Event()
        self.passes = 0
        self.total = ReconcileReport()
        self._on_report = on_report
        self._scheduler = BackgroundScheduler(
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None}
        )

    def _pass(self) -> None:
        if self.stop_event.is_set():
            return
        try:
            report = self.reconciler.reconcile_once(stop=self.stop_event)
        except StorageError as exc:  # the database is away: one line, the next pass retries
            log.warning("reconcile pass skipped: %s", " ".join(exc.message.split()))
            return
        except Exception:  # a bad pass must not kill the daemon; the next one retries
            log.exception("reconcile pass failed")
            return
        self.passes += 1
        self.total.merge(report)
        if self._on_report is not None:
            self._on_report(report)

    def start(self) -> None:
        self._scheduler.add_job(
            self._pass,
            "interval",
            seconds=self.interval.total_seconds(),
            id="reconcile",
            next_run_time=None,
        )
        self._scheduler.start()
        self._scheduler.modify_job("reconcile", next_run_time=datetime.now(UTC))

    def stop(self) -> None:
        """Finish the pass in flight, release unprocessed leases, stop the scheduler."""
        self.stop_event.set()
        if self._scheduler.running:
            self._scheduler.shutdown(wait=True)

    def run(self, *, install_signal_handlers: bool = True) -> ReconcileReport:
        """Block until SIGTERM/SIGINT (or :meth:`stop` from another thread)."""
        if install_signal_handlers:

            def _handler(signum: int, _frame: FrameType | None) -> None:
                log.info("signal %s: finishing the current batch", signum)
                self.stop_event.set()

            signal.signal(signal.SIGTERM, _handler)
            signal.signal(signal.SIGINT, _handler)
        self.start()
        try:
            self.stop_event.wait()
        finally:
            self.stop()
        return self.total
