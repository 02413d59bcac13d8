"""Operation types: the request model, the effect fields that make the fingerprint,
the sensitive fields that are never stored, and the retention window.

The embedding app registers its own types; four money movements come built in.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import (
    Annotated,
    Any,
    Literal,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError
from pydantic_core import PydanticSerializationError
from pydantic_extra_types.currency_code import ISO4217

from .core import (
    canonical_idempotency_key,
    check_encodable,
    fingerprint,
    safe_text,
    validate_operation_name,
    validate_tenant,
)
from .errors import (
    ConfigurationError,
    RequestValidationFailed,
    UnencodableRequest,
    UnknownOperationType,
)
from .records import REDACTED, NewOperation, Redactor

__all__ = [
    "DEFAULT_RETENTION",
    "MONEY_RETENTION",
    "REDACTED",
    "Currency",
    "MinorUnits",
    "OperationType",
    "PaymentCapture",
    "PaymentCreate",
    "Payout",
    "Prepared",
    "Refund",
    "Registry",
    "default_registry",
]

DEFAULT_RETENTION = timedelta(hours=24)
# Money movement keeps its outcome longer: a client retrying days later must still get the
# first answer rather than a second charge.
MONEY_RETENTION = timedelta(days=30)

# Integer minor units only: Strict refuses 10.5 and also 10.0 (a float in disguise).
MinorUnits = Annotated[int, Strict(), Field(ge=0, le=10**15)]
Currency = ISO4217


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PaymentCreate(_Request):
    amount: Annotated[int, Strict(), Field(gt=0, le=10**15)]
    currency: Currency
    customer: str | None = None
    payment_method: str | None = None
    capture_method: Literal["automatic", "manual"] = "automatic"
    description: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class PaymentCapture(_Request):
    payment_intent: str
    amount_to_capture: MinorUnits | None = None


class Refund(_Request):
    payment_intent: str
    amount: Annotated[int, Strict(), Field(gt=0, le=10**15)] | None = None
    currency: Currency | None = None
    reason: str | None = None


class Payout(_Request):
    amount: Annotated[int, Strict(), Field(gt=0, le=10**15)]
    currency: Currency
    destination: str
    description: str | None = None


@dataclass(frozen=True, kw_only=True)
class OperationType:
    """How payorch treats one kind of operation."""

    name: str
    model: type[BaseModel]
    effect_fields: tuple[str, ...]
    provider: str | None = None  # default provider for this type
    sensitive_fields: tuple[str, ...] = ()
    retention: timedelta = DEFAULT_RETENTION
    expired_status: int = 410  # what a request on a reaped key answers (some APIs say 422)

    def __post_init__(self) -> None:
        validate_operation_name(self.name)
        fields = set(self.model.model_fields)
        missing = [f for f in (*self.effect_fields, *self.sensitive_fields) if f not in fields]
        if missing:
            raise ConfigurationError(f"{self.name}: {missing} are not fields of {self.model}")
        if not self.effect_fields:
            raise ConfigurationError(f"{self.name}: at least one effect field is needed")
        overlap = [f for f in self.sensitive_fields if f in self.effect_fields]
        if overlap:
            # The fingerprint is a plain SHA-256 of the effect fields, kept for as long as the
            # tombstone: a card number or an account in it could be recovered by brute force.
            raise ConfigurationError(
                f"{self.name}: {overlap} cannot be both sensitive and effect fields: the "
                "fingerprint would let the value be recovered; fingerprint a token instead"
            )
        for name in self.effect_fields:
            where = unordered_part(self.model.model_fields[name].annotation, name)
            if where is not None:
                raise ConfigurationError(
                    f"{self.name}: effect field {where} is a set, whose JSON order changes "
                    "from process to process (and so would the fingerprint); use a list "
                    "(sorted by the caller) or a tuple"
                )
        if self.retention <= timedelta(0):
            raise ConfigurationError(f"{self.name}: retention must be positive")
        if not 400 <= self.expired_status <= 499:
            raise ConfigurationError(f"{self.name}: expired_status must be a 4xx status")


_UNORDERED = (set, frozenset, collections.abc.Set)


def _nested_fields(tp: Any) -> dict[str, Any] | None:
    """The field annotations of a model, dataclass or TypedDict; None for anything else."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return {n: f.annotation for n, f in tp.model_fields.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = get_type_hints(tp, include_extras=True)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(tp)}
    # A TypedDict, from typing or typing_extensions (pydantic wants the latter before 3.12).
    if isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__"):
        return get_type_hints(tp, include_extras=True)
    return None


def unordered_part(tp: Any, path: str, _seen: frozenset[int] = frozenset()) -> str | None:
    """Where in the annotation ``tp`` a set-like type hides (its path), or None.

    Walks Annotated, Optional/Union, container element types and the fields of nested
    models, dataclasses and TypedDicts; a recursive model is walked once.
    """
    origin = get_origin(tp)
    base = origin if origin is not None else tp
    if isinstance(base, type) and issubclass(base, _UNORDERED):
        return path
    parts: Iterable[tuple[str, Any]]
    if origin is Literal:
        parts = ()  # values, not types
    elif origin is Annotated:
        parts = [(path, get_args(tp)[0])]
    elif getattr(tp, "__supertype__", None) is not None:  # typing.NewType
        parts = [(path, tp.__supertype__)]
    elif (fields := _nested_fields(tp)) is not None:
        parts = () if id(tp) in _seen else [(f"{path}.{n}", a) for n, a in fields.items()]
        _seen = _seen | {id(tp)}
    else:
        # A union's members sit at the same place; a container's element types inside it.
        inner = path if origin in (Union, types.UnionType) else f"{path}[]"
        parts = [(inner, arg) for arg in get_args(tp)]
    for where, annotation in parts:
        found = unordered_part(annotation, where, _seen)
        if found is not None:
            return found
    return None


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A validated request: what to claim and what to send."""

    new: NewOperation
    payload: Mapping[str, Any]  # full validated request (sensitive fields included)
    effect: Mapping[str, Any]
    type: OperationType
    # Set (empty) only when the stored copy hides nothing and says "[redacted]" nowhere: the
    # executor may then skip deriving the redactor from it. None: derive it, as ever.
    redactor: Redactor | None = None


@dataclass
class Registry:
    types: dict[str, OperationType] = field(default_factory=dict)

    def register(self, op_type: OperationType, *, replace: bool = False) -> None:
        if op_type.name in self.types and not replace:
            raise ConfigurationError(f"operation {op_type.name!r} is already registered")
        self.types[op_type.name] = op_type

    def get(self, name: str) -> OperationType:
        validate_operation_name(name)
        try:
            return self.types[name]
        except KeyError:
            raise UnknownOperationType(f"operation {name!r} is not registered") from None

    def names(self) -> Iterable[str]:
        return sorted(self.types)

    def prepare(
        self,
        *,
        tenant_id: str,
        operation: str,
        idempotency_key: str,
        request: Mapping[str, Any] | BaseModel,
        provider: str | None = None,
        key_scope: str = "",
    ) -> Prepared:
        """Validate everything before anything is written: a refusal here reserves nothing."""
        validate_tenant(tenant_id)
        # The sf-string form and the bare token are one key (as payorch.http reads them).
        idempotency_key = canonical_idempotency_key(idempotency_key)
        op_type = self.get(operation)
        provider_name = provider or op_type.provider
        if not provider_name:
            raise ConfigurationError(f"no provider given and none set for {operation!r}")
        try:
            model = (
                request
                if isinstance(request, op_type.model)
                else op_type.model.model_validate(
                    request.model_dump() if isinstance(request, BaseModel) else request
                )
            )
        except ValidationError as exc:
            # The field names and messages may echo the bad input (a lone surrogate as a
            # metadata key): make them encodable, or the error itself cannot be reported.
            errors = [
                {
                    "loc": [p if isinstance(p, int) else safe_text(p) for p in e["loc"]],
                    "msg": safe_text(e["msg"]),
                    "type": e["type"],
                }
                for e in exc.errors()
            ]
            first = errors[0]
            where = ".".join(str(p) for p in first["loc"]) or "request"
            raise RequestValidationFailed(
                f"{operation}: {where}: {first['msg']}", errors=errors
            ) from None
        data = _json_form(model, op_type)
        effect = {name: data.get(name) for name in op_type.effect_fields}
        fp = fingerprint(effect)
        hidden = op_type.sensitive_fields
        # A sensitive value copied into another field (a description, metadata) goes too,
        # by the rule of payorch.records (short values only under a sensitive name). A
        # sensitive field left null stays null: nothing is hidden,
        # and the stored copy is still the request as sent (so it may be sent again).
        redactor = Redactor.for_request(hidden, [data.get(name) for name in hidden])
        stored = dict(redactor.json(data))
        # The effect fields decide the money movement and are never sensitive (refused at
        # registration): kept as sent, so an amount equal to an expiry year stays resendable.
        stored.update(effect)
        amount = data.get("amount")
        currency = data.get("currency")
        new = NewOperation(
            tenant_id=tenant_id,
            operation=operation,
            idempotency_key=idempotency_key,
            fingerprint=fp,
            provider=provider_name,
            request=stored,
            amount=amount if isinstance(amount, int) else None,
            currency=currency if isinstance(currency, str) else None,
            retention=op_type.retention,
            key_scope=key_scope,
        )
        # A caller's own "[redacted]" text makes its key sensitive for Redactor.of (as every
        # later read of the stored copy treats it): then the redactor is derived as ever.
        nothing_hidden = not redactor and Redactor.redacted_at(stored) is None
        return Prepared(
            new=new,
            payload=data,
            effect=effect,
            type=op_type,
            redactor=redactor if nothing_hidden else None,
        )


def _json_form(model: BaseModel, op_type: OperationType) -> dict[str, Any]:
    """The request as JSON, refused (``UnencodableRequest``) unless every encoder downstream
    (JCS, the database, the adapter's HTTP body) can carry it exactly.

    Checked on the Python values first: the JSON dump silently turns an infinite float
    under ``Any`` into null, and would hand a lone surrogate on to the adapter.
    """
    try:
        raw = model.model_dump()
        if not check_encodable(raw):
            for name in op_type.effect_fields:
                # A set smuggled in through an ``Any`` field: registration could not see it.
                check_encodable(raw.get(name), name, sets=False)
        data = model.model_dump(mode="json")
    except (PydanticSerializationError, ValueError) as exc:  # e.g. bytes that are not UTF-8
        raise UnencodableRequest(
            f"{op_type.name}: the request cannot be written as JSON: {safe_text(exc)}"
        ) from None
    check_encodable(data)
    return data


def default_registry(provider: str | None = None) -> Registry:
    """The built-in money movements, all on ``provider`` unless a call names another."""
    reg = Registry()
    for op_type in (
        OperationType(
            name="payment.create",
            model=PaymentCreate,
            effect_fields=("amount", "currency", "customer", "payment_method", "capture_method"),
            provider=provider,
            retention=MONEY_RETENTION,
        ),
        OperationType(
            name="payment.capture",
            model=PaymentCapture,
            effect_fields=("payment_intent", "amount_to_capture"),
            provider=provider,
            retention=MONEY_RETENTION,
        ),
        OperationType(
            name="refund.create",
            model=Refund,
            effect_fields=("payment_intent", "amount", "currency"),
            provider=provider,
            retention=MONEY_RETENTION,
        ),
        OperationType(
            name="payout.create",
            model=Payout,
            effect_fields=("amount", "currency", "destination"),
            provider=provider,
            retention=MONEY_RETENTION,
        ),
    ):
        reg.register(op_type)
    return reg
