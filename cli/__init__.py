"""The ``payorch`` command line: operators' commands, the demo and the sandbox server.

The command line is the interface; every module here is internal (``_private``).
``python -m payorch.cli`` runs the same program as the ``payorch`` script.
"""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """The ``payorch`` console script (imports the commands on first use: ``--help`` is fast)."""
    from ._app import main as run

    run()
