"""A hooks module that fails on import (for the one-line error of the CLI)."""

raise RuntimeError("the application's settings are missing")
