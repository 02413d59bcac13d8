"""The ``payorch`` command line: operators' commands, the demo and the sandbox server.

The command line is the interface; every module here is internal (``_private``).
``python -m payorch.cli`` runs the same program as the ``payorch`` script.
"""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """The ``payorch`` console script (imports the commands on first use: ``--help`` is fast)."""
    import os
    import sys

    # As `python -m` and the app servers do: PAYORCH_PROVIDERS, PAYORCH_OUTBOX_HOOKS and
    # --registry name the app's modules, found from the directory the command runs in.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from ._app import main as run

    run()
