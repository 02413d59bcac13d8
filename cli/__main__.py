"""``python -m payorch.cli``: the ``payorch`` command line."""

from . import main

main()
