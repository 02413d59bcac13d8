"""The sandbox acquirer: a real HTTP server on loopback and the adapter that talks to it."""

from providers.sandbox.adapter import DEFAULT_TIMEOUT, SandboxProvider
from providers.sandbox.api import CommitGate
from providers.sandbox.faults import Fault
from providers.sandbox.server import SandboxServer, serve
from providers.sandbox.webhooks import WebhookDelivery

__all__ = [
    "DEFAULT_TIMEOUT",
    "CommitGate",
    "Fault",
    "SandboxProvider",
    "SandboxServer",
    "WebhookDelivery",
    "serve",
]
