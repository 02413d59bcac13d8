"""Loopback ports for the servers the tests start: a free one, and a start retried on
another when the one picked was taken meanwhile.

A free port is only free when it is probed: another process (a parallel test worker's
cluster or server) may bind it first. Then the server exits on the bind, and the start is
tried again on another port, a bounded number of times."""

from __future__ import annotations

import socket
from collections.abc import Callable

BIND_TRIES = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_on_a_free_port(
    start_once: Callable[[int], None],
    port: int,
    *,
    unavailable: type[Exception],
    taken: Callable[[Exception, int], bool],
) -> int:
    """Run ``start_once(port)``; while it raises ``unavailable`` and ``taken(error, try)``
    says the port was the cause, again on another port. The port it started on."""
    for attempt in range(BIND_TRIES):
        try:
            start_once(port)
        except unavailable as exc:
            if not taken(exc, attempt) or attempt == BIND_TRIES - 1:
                raise
            port = free_port()
            continue
        return port
    raise AssertionError("unreachable: the last try returns or raises")
