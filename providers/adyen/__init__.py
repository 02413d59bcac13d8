"""payorch.providers.adyen: an adapter for Adyen's Checkout API and its notifications."""

from __future__ import annotations

from ._adapter import CAPABILITIES, DEFAULT_TIMEOUT, IDEMPOTENCY_WINDOW, AdyenProvider
from ._classify import RESULT_CODES, SUPPORTED_OPERATIONS
from ._notifications import ACKNOWLEDGEMENT, SIGNED_FIELDS, sign_item, signing_string

__all__ = [
    "ACKNOWLEDGEMENT",
    "CAPABILITIES",
    "DEFAULT_TIMEOUT",
    "IDEMPOTENCY_WINDOW",
    "RESULT_CODES",
    "SIGNED_FIELDS",
    "SUPPORTED_OPERATIONS",
    "AdyenProvider",
    "sign_item",
    "signing_string",
]
