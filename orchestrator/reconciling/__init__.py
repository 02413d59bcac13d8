"""Reconciling: resolving operations from evidence, by status query, webhook or operator.

Internal (every module here is ``_private``): the public names are re-exported by
``payorch`` (``Reconciler``, ``ReconcilerDaemon``, ``WebhookHandler``, …) and
``payorch.operator``. Imports the base, observing, storage and execution.
"""

__all__: list[str] = []
