"""``payorch sandbox serve``: the sandbox acquirer in the foreground until Ctrl-C or SIGTERM,
announcing where it listens on standard output first."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from ._server import SandboxServer

__all__ = ["serve"]


def _announce(sandbox: SandboxServer) -> None:
    # Standard output, flushed: a script (or a test) waits for the first line to know the URL.
    sys.stdout.write("".join(f"{line}\n" for line in sandbox.describe()))
    sys.stdout.flush()


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    on_ready: Callable[[SandboxServer], None] | None = None,
    **kwargs: Any,
) -> None:
    """Serve in the foreground until KeyboardInterrupt or SIGTERM (``payorch sandbox serve``)."""
    stop_requested = threading.Event()
    previous: Any = None
    in_main = threading.current_thread() is threading.main_thread()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()

    if in_main:  # signal handlers can only be installed from the main thread
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with (
            SandboxServer(host=host, port=port, **kwargs) as sandbox,
            contextlib.suppress(KeyboardInterrupt),  # Ctrl-C is the normal way out
        ):
            (on_ready or _announce)(sandbox)
            stop_requested.wait()
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
