"""Routing rules and the router that applies them (no I/O).

A :class:`Rule` matches an operation type's requests by currency, amount range, tenant and
request fields, and names the providers to try, in order, optionally with a volume split
that picks the first of them. :class:`Router` holds the rules (checked once, at start-up),
the decline codes that may move an operation to its next provider, and the providers'
health; :meth:`Router.choose` turns one request into a :class:`Choice`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import namespace_ref
from ..errors import ConfigurationError, NoRoute
from ..provider import AnswerKind
from ._health import Health, HealthPolicy

__all__ = ["Choice", "Router", "Rule"]

_BUCKETS = 10_000  # a split's resolution: 0.01 %
_MISSING = object()
_DEFAULT_HEALTH = HealthPolicy()


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One routing rule of an operation type.

    ``providers``: the order to try them in (a fallback list). ``split``: percentages per
    provider (each one of ``providers``; together 100) that pick the first provider, stable
    per namespace; the others follow in ``providers`` order. Every condition left out
    matches all: ``currencies`` (ISO codes), ``min_amount``/``max_amount`` (minor units,
    both included), ``tenants``, and ``fields`` (a request field, dotted for a nested one,
    equal to a value, or one of a list of values).
    """

    operation: str
    providers: Sequence[str]
    name: str = ""
    split: Mapping[str, float] | None = None
    currencies: Collection[str] | None = None
    min_amount: int | None = None
    max_amount: int | None = None
    tenants: Collection[str] | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The name the stored decision gives the rule."""
        return self.name or f"{self.operation}:{'>'.join(self.providers)}"

    def matches(
        self,
        *,
        tenant_id: str,
        amount: int | None,
        currency: str | None,
        request: Mapping[str, Any],
    ) -> bool:
        return (
            (self.tenants is None or tenant_id in self.tenants)
            and (self.currencies is None or (currency or "").upper() in self._currencies)
            and (self.min_amount is None or (amount is not None and amount >= self.min_amount))
            and (self.max_amount is None or (amount is not None and amount <= self.max_amount))
            and all(_has(request, path, wanted) for path, wanted in self.fields.items())
        )

    @property
    def _currencies(self) -> frozenset[str]:
        return frozenset(c.upper() for c in self.currencies or ())

    def problem(
        self, known: Collection[str], operations: Collection[str] | None = None
    ) -> str | None:
        """What makes this rule unusable with the providers ``known`` (and the operation
        types ``operations``, when given), in a few words."""
        where = f"routing rule {self.label!r}"
        shape = self._shape_problem(where)
        if shape is not None:
            return shape
        if operations is not None and self.operation not in operations:
            return (
                f"{where} routes operation {self.operation!r}, which is not registered "
                f"(registered: {_names(operations)})"
            )
        unknown = next((repr(p) for p in self.providers if p not in known), "")
        problems = (
            (not self.providers, f"{where} names no provider"),
            (
                isinstance(self.providers, str),
                f"{where}: providers must be a list of names, not one string",
            ),
            (
                bool(unknown),
                f"{where} names unknown provider {unknown} (configured: {_names(known)})",
            ),
            (len(set(self.providers)) != len(self.providers), f"{where} names a provider twice"),
            (
                self.min_amount is not None
                and self.max_amount is not None
                and self.min_amount > self.max_amount,
                f"{where}: min_amount {self.min_amount} is above max_amount {self.max_amount}",
            ),
        )
        for wrong, problem in problems:
            if wrong:
                return problem
        if self.split is not None:
            return _split_problem(where, self.split, self.providers)
        return None

    def _shape_problem(self, where: str) -> str | None:
        """A condition of the wrong shape: a lone string where a list of them is meant
        (it would match by substring, or never), fields that are not a mapping."""
        for name in ("tenants", "currencies"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, str) or not all(isinstance(v, str) for v in value)
            ):
                return f"{where}: {name} must be a list of strings, not {value!r}"
        if not isinstance(self.fields, Mapping) or not all(
            isinstance(k, str) and k for k in self.fields
        ):
            return f"{where}: fields must map request field names to values"
        for bound in ("min_amount", "max_amount"):
            value = getattr(self, bound)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                return f"{where}: {bound} must be an integer (minor units), not {value!r}"
        return None

    def order(self, ref: str) -> list[str]:
        """The providers in the order to try them for the namespace of ``ref``."""
        providers = list(self.providers)
        if not self.split:
            return providers
        # Stable per namespace: the same key always draws the same first provider.
        digest = hashlib.sha256(f"{self.label}\x00{ref}".encode()).digest()
        draw = int.from_bytes(digest[:8], "big") % _BUCKETS
        upto = 0.0
        first = providers[0]
        for provider in providers:
            upto += self.split.get(provider, 0.0) * _BUCKETS / 100
            if draw < upto:
                first = provider
                break
        return [first, *(p for p in providers if p != first)]


def _split_problem(where: str, split: Mapping[str, float], providers: Sequence[str]) -> str | None:
    for provider, share in split.items():
        if provider not in providers:
            return f"{where}: its split names {provider!r}, which is not one of its providers"
        if isinstance(share, bool) or not isinstance(share, int | float):
            return f"{where}: the split of {provider!r} must be a number, not {share!r}"
        if not (math.isfinite(share) and 0 <= share <= 100):
            return f"{where}: the split of {provider!r} must be 0-100 (percent), not {share}"
    total = sum(split.values())
    if not math.isclose(total, 100.0, abs_tol=1e-9):
        return f"{where}: its split adds up to {total:g}%, not 100%"
    return None


def _names(known: Collection[str]) -> str:
    return ", ".join(sorted(known)) or "none"


def _has(request: Mapping[str, Any], path: str, wanted: Any) -> bool:
    """Whether the request's field at ``path`` is ``wanted``, or one of a list of them."""
    found = _field(request, path)
    choices = wanted if isinstance(wanted, list | tuple | set | frozenset) else (wanted,)
    return found is not _MISSING and found in choices


def _field(request: Mapping[str, Any], path: str) -> Any:
    value: Any = request
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


@dataclass(frozen=True)
class Choice:
    """A request's route: the rule that matched, the providers in the order to try them
    (healthy ones first), and those passed over as unhealthy (still tried, last)."""

    rule: str
    providers: tuple[str, ...]
    skipped: tuple[str, ...] = ()


class Router:
    """Routes operations among providers (``payorch.routing``; docs/routing.md).

    ``rules``: tried in order per operation type, the first that matches wins.
    ``fallback_declines``: decline codes that prove, for this router, that an attempt did
    not execute and another provider may be asked (none by default: a decline is final).
    ``health``: when a provider failing its recent calls is passed over for new operations
    (by default :class:`HealthPolicy`'s); None: never. A rule naming an unknown provider,
    or a split that cannot be, is refused when an executor is built with the router
    (:meth:`check`), in one line.
    """

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        fallback_declines: Iterable[str] = (),
        health: HealthPolicy | None = _DEFAULT_HEALTH,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.rules = tuple(rules)
        if isinstance(fallback_declines, str):
            raise ConfigurationError("fallback_declines must be a list of decline codes")
        self.fallback_declines = frozenset(fallback_declines)
        self.health = Health(health or HealthPolicy(), clock=clock, on=health is not None)
        self._by_operation: dict[str, tuple[Rule, ...]] = {}
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise ConfigurationError(f"a routing rule must be a Rule, not {rule!r}")
            self._by_operation.setdefault(rule.operation, ())
            self._by_operation[rule.operation] += (rule,)

    def check(self, known: Collection[str], operations: Collection[str] | None = None) -> None:
        """Refuse (``ConfigurationError``, one line) a rule that cannot route with the
        providers ``known`` (and, when given, the registered operation types)."""
        for rule in self.rules:
            problem = rule.problem(known, operations)
            if problem is not None:
                raise ConfigurationError(problem)

    def routes(self, operation: str) -> bool:
        """Whether operations of this type are routed (some rule names it)."""
        return operation in self._by_operation

    def choose(
        self,
        *,
        tenant_id: str,
        operation: str,
        idempotency_key: str,
        request: Mapping[str, Any],
        amount: int | None,
        currency: str | None,
        key_scope: str = "",
    ) -> Choice:
        """The route of one new request; ``NoRoute`` (422) if no rule of its type matches."""
        for rule in self._by_operation.get(operation, ()):
            if rule.matches(tenant_id=tenant_id, amount=amount, currency=currency, request=request):
                ref = namespace_ref(tenant_id, operation, idempotency_key, key_scope)
                order = rule.order(ref)
                healthy = [p for p in order if self.health.healthy(p)]
                skipped = tuple(p for p in order if p not in healthy)
                return Choice(rule.label, (*healthy, *skipped), skipped)
        raise NoRoute(
            f"no routing rule of operation {operation!r} matches this request "
            f"(currency {currency!r}, amount {amount!r}, tenant {tenant_id!r}); nothing was "
            "stored: fix the request or add a rule",
            operation=operation,
        )

    def may_fall_back(self, kind: AnswerKind, code: str | None) -> bool:
        """Whether a final decline with ``code`` lets the operation move on."""
        return kind is AnswerKind.DECLINED and code is not None and code in self.fallback_declines
