"""Reading the ``payorch_*`` tags of a provider's effect (:mod:`._unexplained`): whose they
are (this installation's key scope, or another's), whether payorch could have sent them, and
whether the namespace they name can be given the effect (adopted)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ..core import (
    attempt_ref,
    canonical_idempotency_key,
    downstream_key,
    namespace_ref,
    validate_key_scope,
    validate_operation_name,
    validate_tenant,
)
from ..errors import InvalidRequest
from ..provider import (
    TAG_FINGERPRINT,
    TAG_KEY,
    TAG_LEGACY_OPERATION_ID,
    TAG_OPERATION,
    TAG_REF,
    TAG_TENANT,
    AnswerKind,
    ProviderEffect,
)

__all__ = [
    "adoption_refusal",
    "foreign_tags",
    "installation_scope",
    "malformed_tags",
    "not_ours",
    "routed_at",
    "storable",
]

_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_REF = re.compile(r"[0-9a-f]{32}")  # namespace_ref's form
_OPERATION_ID = re.compile(r"[\x21-\x7e]{1,36}")  # what payorch_operations.id can hold
_STORABLE = 255  # the longest downstream key or provider reference a row can hold
_ADOPTABLE = frozenset({AnswerKind.SUCCEEDED, AnswerKind.DECLINED, AnswerKind.PENDING})


def installation_scope(key_scope: str | None = None) -> str:
    """This installation's key scope: ``key_scope``, or for None the environment's
    ``PAYORCH_KEY_SCOPE``, as the :class:`~payorch.Executor` reads it (only that
    variable); ``ConfigurationError`` for a scope that is not one."""
    return validate_key_scope(
        os.environ.get("PAYORCH_KEY_SCOPE", "") if key_scope is None else key_scope
    )


# -- reading the tags ----------------------------------------------------------------------


def malformed_tags(tags: Mapping[str, str]) -> str | None:
    """Why these tags are not what payorch sends (they name no namespace any request of
    payorch's could have), or None. Checked before anything is looked up by them: the
    store's reads take only values its own validation accepts."""
    try:
        validate_tenant(tags.get(TAG_TENANT))
        if TAG_OPERATION in tags:
            validate_operation_name(tags[TAG_OPERATION])
        if TAG_KEY in tags:
            canonical_idempotency_key(tags[TAG_KEY])
    except InvalidRequest as exc:
        return f"its tags are malformed: {exc.message}"
    if TAG_REF in tags and not _REF.fullmatch(tags[TAG_REF]):
        return f"its tags are malformed: {TAG_REF} is not 32 hex digits"
    legacy = tags.get(TAG_LEGACY_OPERATION_ID)
    if legacy is not None and not _OPERATION_ID.fullmatch(legacy):
        return f"its tags are malformed: {TAG_LEGACY_OPERATION_ID} is no operation id"
    return None


def foreign_tags(tags: Mapping[str, str], scope: str, provider: str | None = None) -> str | None:
    """Why well-formed tags naming a whole namespace are another installation's: their ref
    is neither the namespace's under ``scope`` nor, for an effect listed at ``provider``, a
    routed attempt's there (payorch.routing). None when it is (or there is no ref to tell)."""
    ref, operation, key = tags.get(TAG_REF), tags.get(TAG_OPERATION), tags.get(TAG_KEY)
    if ref is None or operation is None or key is None:
        return None
    tenant = tags[TAG_TENANT]
    if ref == namespace_ref(tenant, operation, key, scope):
        return None
    if provider is not None and routed_at(tags, scope, provider):
        return None
    here = f"key scope {scope!r}" if scope else "no key scope (PAYORCH_KEY_SCOPE unset)"
    if scope and ref == namespace_ref(tenant, operation, key):
        made = "made under no key scope"
    else:
        made = "made under another key scope"
    return (
        f"its {TAG_REF} is not its namespace's under this installation's {here}: {made}, "
        "by another installation sharing the provider account"
    )


def routed_at(tags: Mapping[str, str], scope: str, provider: str) -> bool:
    """Whether well-formed tags are a routed attempt's at ``provider`` (their ref is the
    attempt's, ``payorch.core.attempt_ref`` of the namespace's and the provider's name)."""
    ref, operation, key = tags.get(TAG_REF), tags.get(TAG_OPERATION), tags.get(TAG_KEY)
    if ref is None or operation is None or key is None:
        return False
    namespace = namespace_ref(tags[TAG_TENANT], operation, key, scope)
    return ref == attempt_ref(namespace, provider)


def not_ours(
    effect: ProviderEffect, *, key_scope: str | None = None, provider: str | None = None
) -> str | None:
    """Why ``effect`` (listed at ``provider``) is not this installation's to judge (no
    payorch tags, or tags made under another key scope), or None if it is. Malformed tags
    are ours to report."""
    if not effect.ours:
        return "it carries no payorch tags"
    if malformed_tags(effect.tags) is not None:
        return None
    return foreign_tags(effect.tags, installation_scope(key_scope), provider)


def storable(text: str) -> bool:
    """Whether a row can hold ``text`` (a provider's own reference or key) and be found."""
    if len(text) > _STORABLE or "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def adoption_refusal(effect: ProviderEffect, *, key_scope: str | None = None) -> str | None:
    """Why ``effect`` cannot be adopted as its namespace's operation under ``key_scope``
    (None: the environment's); None if it can (no store read)."""
    reason = malformed_tags(effect.tags) or _tags_refusal(
        effect.tags, installation_scope(key_scope)
    )
    if reason is not None:
        return reason
    expected = downstream_key(effect.tags[TAG_REF])
    if effect.downstream_key is not None and effect.downstream_key != expected:
        return f"the provider saw key {effect.downstream_key!r}, not the namespace's {expected!r}"
    if not storable(effect.provider_reference):
        return "its provider reference cannot be stored (too long, or not text)"
    if effect.kind not in _ADOPTABLE:
        return f"its status could not be read as an outcome ({effect.kind.value})"
    return None


def _tags_refusal(tags: Mapping[str, str], scope: str) -> str | None:
    """Why well-formed tags do not name one namespace and its fingerprint; None if they do."""
    if TAG_REF not in tags:
        return (
            "tagged before keys came from the namespace: its idempotency key and fingerprint "
            "are unknown; settle it by hand"
        )
    missing = [t for t in (TAG_OPERATION, TAG_KEY, TAG_FINGERPRINT) if t not in tags]
    if missing:
        return (
            f"its tags lack {', '.join(missing)} (sent before fingerprints were): a retry "
            "could not be matched to the fields it was made with; settle it by hand"
        )
    if not _FINGERPRINT.fullmatch(tags[TAG_FINGERPRINT]):
        return f"its {TAG_FINGERPRINT} is not a SHA-256 hex digest"
    ref = namespace_ref(tags[TAG_TENANT], tags[TAG_OPERATION], tags[TAG_KEY], scope)
    if tags[TAG_REF] != ref:
        return f"its {TAG_REF} is not its namespace's ({ref}) under this installation's scope"
    if canonical_idempotency_key(tags[TAG_KEY]) != tags[TAG_KEY]:
        # Its downstream key comes from the quoted form; rows hold keys bare (0003).
        return "its key is in quoted form (sent before keys were stored bare); settle it by hand"
    return None
