"""A routing table from a file (TOML or JSON) or a mapping: :func:`load_router`.

::

    fallback_declines = ["issuer_unavailable"]

    [health]                       # left out: the defaults; health = false: never skip
    window_seconds = 60
    calls = 10
    min_calls = 5
    failure_ratio = 0.5
    cool_off_seconds = 30

    [[rules]]
    name = "eu-cards"
    operation = "payment.create"
    providers = ["acquirer_a", "acquirer_b"]
    split = { acquirer_a = 70, acquirer_b = 30 }
    currencies = ["EUR"]

Anything the file gets wrong is one line of ``ConfigurationError``, naming where.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigurationError
from ._health import HealthPolicy
from ._rules import Router, Rule

__all__ = ["load_router", "router_from_mapping"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


_DAY = 86_400.0
_MEMBER = re.compile(r"^(_[A-Z]\w*|bool)$")


class _Health(_Strict):
    window_seconds: float = Field(default=60.0, gt=0, le=_DAY, allow_inf_nan=False)
    calls: int = Field(default=10, ge=1, le=10_000)
    min_calls: int = Field(default=5, ge=1, le=10_000)
    failure_ratio: float = Field(default=0.5, gt=0, le=1, allow_inf_nan=False)
    cool_off_seconds: float = Field(default=30.0, ge=0, le=_DAY, allow_inf_nan=False)


class _Rule(_Strict):
    operation: str
    providers: list[str]
    name: str = ""
    split: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    currencies: list[str] | None = None
    min_amount: int | None = None
    max_amount: int | None = None
    tenants: list[str] | None = None
    fields: dict[str, Any] = Field(default_factory=dict)


class _Table(_Strict):
    rules: list[_Rule]
    fallback_declines: list[str] = Field(default_factory=list)
    health: _Health | bool = True


def router_from_mapping(data: Mapping[str, Any], *, source: str = "routing table") -> Router:
    """The :class:`Router` a mapping describes (the file's form)."""
    try:
        table = _Table.model_validate(dict(data), strict=False)
    except ValidationError as exc:
        first = exc.errors()[0]
        # The path as the file writes it: without the model names of a union's members.
        where = ".".join(str(p) for p in first["loc"] if not _MEMBER.match(str(p)))
        where = where or "top level"
        raise ConfigurationError(f"{source}: {where}: {first['msg']}") from None
    health: HealthPolicy | None = None
    if isinstance(table.health, _Health):
        h = table.health
        health = HealthPolicy(
            window=timedelta(seconds=h.window_seconds),
            calls=h.calls,
            min_calls=h.min_calls,
            failure_ratio=h.failure_ratio,
            cool_off=timedelta(seconds=h.cool_off_seconds),
        )
    elif table.health:
        health = HealthPolicy()
    rules = [
        Rule(
            operation=r.operation,
            providers=tuple(r.providers),
            name=r.name,
            split=r.split,
            currencies=r.currencies,
            min_amount=r.min_amount,
            max_amount=r.max_amount,
            tenants=r.tenants,
            fields=r.fields,
        )
        for r in table.rules
    ]
    return Router(rules, fallback_declines=table.fallback_declines, health=health)


def load_router(path: str | Path) -> Router:
    """The :class:`Router` of a TOML (``.toml``) or JSON file; ``ConfigurationError`` in one
    line for a file that cannot be read or says something a router cannot be."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"routing table {file}: cannot be read ({exc})") from None
    try:
        data = tomllib.loads(text) if file.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigurationError(
            f"routing table {file}: not valid {file.suffix[1:]}: {exc}"
        ) from None
    if not isinstance(data, Mapping):
        raise ConfigurationError(f"routing table {file}: must be a table of rules")
    return router_from_mapping(data, source=f"routing table {file}")
