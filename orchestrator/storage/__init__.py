"""Storage: the operations and webhook tables, every statement payorch runs, and the stores.

Internal (every module here is ``_private``): the public names are re-exported by
``payorch`` (``Store``, ``AsyncStore``) and ``payorch.db`` (``create_engine``). Imports
the base modules at the top of ``payorch`` and ``payorch.observing`` only.
"""

__all__: list[str] = []
