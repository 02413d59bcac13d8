"""payorch.providers.adyen: an adapter for Adyen's Checkout API and its notifications."""

__all__: list[str] = []
