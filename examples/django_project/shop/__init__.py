"""A small shop that takes payments through payorch (the Django example project)."""
