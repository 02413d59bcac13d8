"""``python -m payorch.cli``: the ``payorch`` command line."""

from . import main

if __name__ == "__main__":
    main()
