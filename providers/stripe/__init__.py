"""Stripe adapter for payorch: PaymentIntents and Refunds behind the Provider protocol."""

from __future__ import annotations

from ._adapter import DEFAULT_TIMEOUT, DEFAULT_WEBHOOK_TOLERANCE, IDEMPOTENCY_WINDOW, StripeProvider
from ._classify import SUPPORTED_OPERATIONS
from ._webhooks import SIGNATURE_HEADER

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_WEBHOOK_TOLERANCE",
    "IDEMPOTENCY_WINDOW",
    "SIGNATURE_HEADER",
    "SUPPORTED_OPERATIONS",
    "StripeProvider",
]
