"""Effects of routed operations as a provider's listing shows them: whether one is a
second effect beside its operation's route (payorch.routing), for the look for effects no
operation explains (``_unexplained``)."""

from __future__ import annotations

from ..core import downstream_key
from ..provider import TAG_REF, AnswerKind, ProviderEffect
from ..records import OperationRecord
from ..routing import touched
from ..storage._store import Store
from ._cross_flags import CROSS_DUPLICATE, same_late

__all__ = ["beside_route", "known_duplicate", "left_behind"]


def beside_route(
    store: Store,
    record: OperationRecord,
    provider: str,
    effect: ProviderEffect,
    *,
    routed_effect: bool,
) -> str | None:
    """Why ``effect`` at ``provider`` is a second effect of ``record``: it was made by a
    routed attempt (``routed_effect``) or ``record`` is routed, and ``record`` never sent the
    namespace there under the key the effect was made with (a claim lost in a failover,
    routed again elsewhere); None when the operation knows it."""
    if record.route is None and not routed_effect:
        return None
    tags = effect.tags
    seen = effect.downstream_key or (downstream_key(tags[TAG_REF]) if TAG_REF in tags else None)
    sent = touched(record.route) or [(record.provider, record.downstream_key)]
    if seen is None or (provider, seen) == (record.provider, record.downstream_key):
        return None
    if (provider, seen) in sent:
        return left_behind(store, record, provider, effect)
    return (
        f"a cross-provider duplicate: routed operation {record.id} stands at "
        f"{record.provider}, and its route never sent it to {provider} under {seen}; "
        "refund one of the two"
    )


def left_behind(
    store: Store, record: OperationRecord, provider: str, effect: ProviderEffect
) -> str | None:
    """Why an effect at a provider ``record`` moved away from is a second one: money there
    (succeeded, or under way) that the operation's own record of a cross-provider duplicate
    does not name yet; None for a decline, or one already recorded."""
    if effect.kind not in (AnswerKind.SUCCEEDED, AnswerKind.PENDING):
        return None
    if known_duplicate(store, record, provider, effect.provider_reference):
        return None
    return (
        f"a cross-provider duplicate: routed operation {record.id} moved from {provider} "
        f"to {record.provider}, and this late effect at {provider} is not recorded on it yet "
        "(the reconciler's look will flag it); refund one of the two"
    )


def known_duplicate(
    store: Store, record: OperationRecord, provider: str, reference: str | None
) -> bool:
    """Whether ``record``'s own record of a cross-provider duplicate names the effect
    ``reference`` at ``provider`` (the reconciler or a webhook found it)."""
    if reference is None:
        return False
    return any(
        e.kind == CROSS_DUPLICATE and same_late(e.detail, provider, "", reference)
        for e in store.events(record.tenant_id, record.id)
    )
