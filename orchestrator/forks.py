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

import functools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["reset_in_child"]

_T = TypeVar("_T")

# By identity, not equality: equal objects (two frozen dataclasses alike) each need their
# own reset, and an unhashable one may register too. Held weakly: an object gone needs no
# reset, and its entry goes with it. A reset takes the object as its argument, so it holds
# no reference of its own.
_RESETS: dict[int, tuple[weakref.ref[Any], list[Callable[[Any], None]]]] = {}


def reset_in_child(obj: _T, reset: Callable[[_T], None]) -> None:
    """Run ``reset(obj)`` in every child process forked while ``obj`` lives (after any reset
    registered for it before). The reset must be quick and must not do I/O: it runs before
    the child's own code, in every child, ``subprocess`` children with a ``preexec_fn`` too."""
    key = id(obj)
    entry = _RESETS.get(key)
    if entry is None or entry[0]() is not obj:
        entry = _RESETS[key] = (weakref.ref(obj, functools.partial(_forget, key)), [])
    entry[1].append(reset)


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    entry = _RESETS.get(key)
    if entry is not None and entry[0] is ref:  # not a newer object that took the same id
        del _RESETS[key]


def _after_fork_in_child() -> None:
    for ref, resets in list(_RESETS.values()):
        obj = ref()
        if obj is None:
            continue
        for reset in resets:
            try:
                reset(obj)
            except Exception:  # one failure must not leave the others shared
                logging.getLogger("payorch").exception("resetting %r after a fork failed", obj)


os.register_at_fork(after_in_child=_after_fork_in_child)
