"""The adapter kit's test class: every check of payorch's provider contract in one base."""

from __future__ import annotations

from ._async_checks import AsyncContract
from ._resends import ResendContract
from ._routes import RouteContract
from ._submits import SubmitContract
from ._voids import VoidContract
from ._webhook_checks import WebhookContract

__all__ = ["AdapterContract"]


class AdapterContract(
    SubmitContract, ResendContract, WebhookContract, VoidContract, AsyncContract, RouteContract
):
    """Subclass it as ``Test…`` and give it an ``emulator`` fixture; pytest collects every
    check. Each asserts what the emulator counted or what the adapter answered, and skips,
    saying why, only where the adapter's declaration (its capabilities, its window) or the
    emulator's ``batches`` say it does not apply. A check that needs a fault the emulator
    cannot inject fails, naming the hook to implement: skipped, it would leave the adapter
    unproven and the run green.
    """
