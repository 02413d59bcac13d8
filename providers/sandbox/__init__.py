"""The sandbox acquirer: a real HTTP server on loopback and the adapter that talks to it."""

from payorch.providers.sandbox.adapter import DEFAULT_TIMEOUT, SandboxProvider
from payorch.providers.sandbox.api import CommitGate
from payorch.providers.sandbox.faults import Fault
from payorch.providers.sandbox.server import SandboxServer, serve
from payorch.providers.sandbox.webhooks import WebhookDelivery

__all__ = [
    "DEFAULT_TIMEOUT",
    "CommitGate",
    "Fault",
    "SandboxProvider",
    "SandboxServer",
    "WebhookDelivery",
    "serve",
]
