"""Stripe adapter for payorch: PaymentIntents and Refunds behind the Provider protocol."""

from __future__ import annotations

from .adapter import DEFAULT_TIMEOUT, DEFAULT_WEBHOOK_TOLERANCE, IDEMPOTENCY_WINDOW, StripeProvider
from .classify import SUPPORTED_OPERATIONS
from .webhooks import SIGNATURE_HEADER

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_WEBHOOK_TOLERANCE",
    "IDEMPOTENCY_WINDOW",
    "SIGNATURE_HEADER",
    "SUPPORTED_OPERATIONS",
    "StripeProvider",
]
