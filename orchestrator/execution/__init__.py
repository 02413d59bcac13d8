"""Execution: one payment operation from claim to recorded outcome, sync and async.

Internal (every module here is ``_private``): ``Executor``, ``AsyncExecutor`` and
``RetryPolicy`` are re-exported by ``payorch``. Imports the base, observing and storage.
"""

__all__: list[str] = []
