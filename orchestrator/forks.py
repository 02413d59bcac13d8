"""What a forked child must not share with its parent.

A process that forks (gunicorn's ``--preload``, multiprocessing's ``fork`` start method,
Celery's prefork pool) gives the child copies of the parent's open sockets and of its locks
as they stood. A pooled database connection used by both would carry two processes'
statements on one session, each reading the other's results; a lock held by another thread
at the fork is never released in the child. Objects holding such things register a reset
here; it runs in the child right after the fork, before the child's own code, and lets go of
them without closing them: closing a socket's session from the child ends the parent's too.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["reset_in_child"]

_T = TypeVar("_T")

# Held weakly: an object gone needs no reset. The reset takes the object as its argument,
# so it holds no reference of its own.
_RESETS: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()


def reset_in_child(obj: _T, reset: Callable[[_T], None]) -> None:
    """Run ``reset(obj)`` in every child process forked while ``obj`` lives."""
    _RESETS[obj] = reset


def _after_fork_in_child() -> None:
    for obj, reset in list(_RESETS.items()):
        try:
            reset(obj)
        except Exception:  # one failure must not leave the others shared
            logging.getLogger("payorch").exception("resetting %r after a fork failed", obj)


os.register_at_fork(after_in_child=_after_fork_in_child)
