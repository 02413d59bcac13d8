"""The sandbox acquirer: a real HTTP server on loopback and the adapter that talks to it."""

from ._adapter import DEFAULT_TIMEOUT, SandboxProvider
from ._api import CommitGate
from ._faults import Fault
from ._serve import serve
from ._server import SandboxServer
from ._webhooks import WebhookDelivery

__all__ = [
    "DEFAULT_TIMEOUT",
    "CommitGate",
    "Fault",
    "SandboxProvider",
    "SandboxServer",
    "WebhookDelivery",
    "serve",
]
