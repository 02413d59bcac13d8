"""What payorch stores of an operation: the plain values the store hands out and takes in,
and the one redaction every stored copy of provider text goes through.

**Redaction** (:class:`Redactor`): a sensitive request value is stored nowhere, even where a
provider echoes it, and nothing else is garbled on its account. One function decides what
every stored copy of provider text looks like (the stored request, the stored response, event
details via :meth:`Redactor.answer`, webhook inbox bodies): a :class:`Redactor` built from an
operation's request. The sensitive *names* are the sensitive fields' and, where one holds an
object or a list (a ``card`` with ``number``, ``cvc``, ``exp_month``), every key inside it; the
sensitive *values*, every text and number inside a sensitive field. It replaces with
``[redacted]``:

- Under a sensitive name, at any depth, the whole value, whatever it is, unless it is null.
- A sensitive text of three characters or more (a name), unless made only of digits, or a
  number or digit-only text of eight digits or more (a card or account number: 12-19),
  wherever a whole value (string, key or number) equals it; a number's text counts too.
  From four characters also inside any longer string (a message quoting a card number, a
  truncated raw body, which also loses a trailing partial value).
- Any other sensitive value: a text of one or two characters, a number or digit-only text of
  fewer than eight digits (an expiry month of 12, a year of 2030, a CVC "737"), only where
  its whole value is equal *and* its key names a sensitive field: a sensitive name, or one's
  words in order (``card_exp_month``, ``expYear`` for ``exp_year``). An expiry year of 2030
  leaves an ``amount`` of 2030, a ``"2030"`` reference and "due 2030" alone.
  A boolean is never a sensitive value (only under a sensitive name does it go).

Limits, by that rule: a short value or a number under eight digits under a key naming no
sensitive field (``{"m": 12}``, a CVC echoed as ``{"code": "737"}``) stays, and so does a
three-character text inside a longer one ("737 g"). An equal value that is not the secret
goes too: a sensitive object's ``"EUR"`` hides the currency, its ``type`` key every ``type``
in the operation's stored provider text. The stored request keeps the operation type's effect
fields as sent (they are never sensitive; see :mod:`payorch.operations`).

While the full request is in hand (``execute()``, its retries, a take-over) all of that is
known; afterwards only the stored request (docs/semantics.md, "Redaction"). A stored request
holding ``[redacted]`` anywhere (:meth:`Redactor.redacted_at`) is never re-sent.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from .core import State, downstream_key, namespace_ref
from .errors import CorruptRecord

if TYPE_CHECKING:
    from .provider import Answer

__all__ = [
    "OPERATION_COLUMNS",
    "REDACTED",
    "ClaimResult",
    "EventRecord",
    "NewOperation",
    "OperationRecord",
    "Redactor",
    "Undecodable",
    "json_ready",
]


def json_ready(record: Any) -> dict[str, Any]:
    """A record dataclass's fields for JSON: times as ISO 8601, states as their values."""
    out: dict[str, Any] = {}
    for name in record.__dataclass_fields__:
        value = getattr(record, name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, State):
            value = value.value
        out[name] = value
    return out


class Undecodable:
    """A stored value its column's type could not decode (SQLite only: it stores any text).

    Result processing hands this back instead of raising, so one corrupt row surfaces as a
    typed ``CorruptRecord`` when it is turned into a record, and never aborts the statement
    (or the reconciler's batch) that read it along with healthy rows.
    """

    __slots__ = ("error", "raw")

    def __init__(self, raw: object, error: Exception) -> None:
        self.raw = raw
        self.error = error

    def __repr__(self) -> str:
        return f"Undecodable({self.raw!r:.60}, {self.error})"


# What each column must read back as: (types, nullable). SQLite stores whatever it is given,
# and an operator may have edited a row by hand, so a record checks its row before use.
# A column's kind: the exact classes a healthy value has (fast path), the classes it may
# have (subclasses, slow path), and what to call it in a message.
_KINDS: dict[str, tuple[frozenset[type], tuple[type, ...], str]] = {
    "text": (frozenset({str}), (str,), "text"),
    "int": (frozenset({int}), (int,), "an integer"),
    "flag": (frozenset({bool}), (bool,), "a boolean"),
    "time": (frozenset({datetime}), (datetime,), "a timestamp"),
    "object": (frozenset({dict}), (Mapping,), "a JSON object"),
}
_OPERATION_COLUMNS = {
    "tenant_id": "text",
    "id": "text",
    "operation": "text",
    "idempotency_key": "text",
    "fingerprint": "text",
    "state": "text",
    "provider": "text",
    "downstream_key": "text",
    "provider_reference": "text?",
    "amount": "int?",
    "currency": "text?",
    "request": "object?",
    "response": "object?",
    "error_code": "text?",
    "resolution": "text?",
    "retention_seconds": "int",
    "possibly_sent": "flag",
    "attempts": "int",
    "checks": "int",
    "next_check_at": "time?",
    "needs_attention": "flag",
    "lease_owner": "text?",
    "lease_expires_at": "time?",
    "version": "int",
    "created_at": "time",
    "updated_at": "time",
    "completed_at": "time?",
    "retain_until": "time?",
    "reaped_at": "time?",
}
_EVENT_COLUMNS = {
    "tenant_id": "text",
    "id": "text",
    "operation_id": "text",
    "kind": "text",
    "actor": "text",
    "from_state": "text?",
    "to_state": "text?",
    "version": "int?",
    "detail": "object?",
    "created_at": "time",
}
# The record's columns in order: what the hand-written PostgreSQL statements return.
OPERATION_COLUMNS: tuple[str, ...] = tuple(_OPERATION_COLUMNS)
_TIME_COLUMNS = tuple(n for n, spec in _OPERATION_COLUMNS.items() if spec.startswith("time"))

# (column, kind, nullable, exact classes accepted at once): built once, read per row.
Shape = tuple[tuple[str, str, bool, frozenset[type]], ...]


def _shape(columns: Mapping[str, str]) -> Shape:
    out = []
    for name, spec in columns.items():
        kind, nullable = spec.rstrip("?"), spec.endswith("?")
        exact = _KINDS[kind][0] | ({type(None)} if nullable else set())
        out.append((name, kind, nullable, exact))
    return tuple(out)


_OPERATION_SHAPE = _shape(_OPERATION_COLUMNS)
_EVENT_SHAPE = _shape(_EVENT_COLUMNS)


def _problem(values: Mapping[str, Any], shape: Shape) -> str | None:
    """What is wrong with a row's values, in one line, or None if each is what it should be.

    Runs on every row read (the claim's included): a healthy value costs one set lookup.
    """
    for name, kind, nullable, exact in shape:
        value = values[name]
        if value.__class__ not in exact:
            problem = _explain(name, value, kind, nullable)
            if problem is not None:
                return problem
    return None


def _explain(name: str, value: Any, kind: str, nullable: bool) -> str | None:
    _, allowed, called = _KINDS[kind]
    if value is None:
        return None if nullable else f"{name}: missing"
    if isinstance(value, Undecodable):
        # The stored text itself may hold sensitive data: name the error, not the value.
        what = "not valid JSON" if kind == "object" else f"not {called}"
        return f"{name}: {what} ({type(value.error).__name__}: {value.error})"[:300]
    if isinstance(value, allowed) and not (kind == "int" and isinstance(value, bool)):
        return None  # a subclass some driver hands out: fine
    return f"{name}: {type(value).__name__} where {called} belongs"


def _corrupt(values: Mapping[str, Any], operation_id: Any, problem: str) -> CorruptRecord:
    tenant = str(values.get("tenant_id"))
    op_id = str(operation_id)
    return CorruptRecord(
        f"operation {op_id} of tenant {tenant} has a corrupt stored row ({problem}): it "
        "needs an operator's repair; clients retry the same idempotency key later",
        tenant_id=tenant,
        operation_id=op_id,
        problem=problem,
    )


@dataclass(frozen=True, kw_only=True)
class NewOperation:
    """What a claim inserts: the namespace, its fingerprint and the effect it stands for."""

    tenant_id: str
    operation: str
    idempotency_key: str
    fingerprint: str
    provider: str
    request: Mapping[str, Any] | None = None  # already redacted
    amount: int | None = None
    currency: str | None = None
    retention: timedelta = timedelta(hours=24)
    key_scope: str = ""  # the installation's (PAYORCH_KEY_SCOPE): part of every ref

    @property
    def downstream_key(self) -> str:
        """The provider idempotency key: from the namespace, never from a per-claim id."""
        ref = namespace_ref(self.tenant_id, self.operation, self.idempotency_key, self.key_scope)
        return downstream_key(ref)


@dataclass(frozen=True, kw_only=True)
class OperationRecord:
    tenant_id: str
    id: str
    operation: str
    idempotency_key: str
    fingerprint: str
    state: State
    provider: str
    downstream_key: str
    provider_reference: str | None
    amount: int | None
    currency: str | None
    request: Mapping[str, Any] | None
    response: Mapping[str, Any] | None
    error_code: str | None
    resolution: str | None
    retention_seconds: int
    possibly_sent: bool
    attempts: int
    checks: int
    next_check_at: datetime | None
    needs_attention: bool
    lease_owner: str | None
    lease_expires_at: datetime | None
    version: int
    created_at: datetime
    updated_at: datetime
    completed_at: datetime | None
    retain_until: datetime | None
    reaped_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> OperationRecord:
        """The record a row holds; ``CorruptRecord`` if the row cannot be what it claims."""
        return cls._checked({name: row[name] for name in _OPERATION_COLUMNS})

    @classmethod
    def from_pg(cls, row: Sequence[Any]) -> OperationRecord:
        """The record of a row read without SQLAlchemy's types: ``OPERATION_COLUMNS`` in
        order, timestamps as psycopg hands them (in the session's time zone)."""
        values = dict(zip(OPERATION_COLUMNS, row, strict=False))
        for name in _TIME_COLUMNS:
            value = values[name]
            if value is not None and value.__class__ is datetime and value.tzinfo is not UTC:
                values[name] = value.astimezone(UTC)
        return cls._checked(values)

    @classmethod
    def _checked(cls, values: dict[str, Any]) -> OperationRecord:
        problem = _problem(values, _OPERATION_SHAPE)
        if problem is None:
            try:
                values["state"] = State(values["state"])
            except ValueError:
                problem = f"state: {values['state']!r:.40} is not a state"
        if problem is not None:
            raise _corrupt(values, values["id"], problem)
        # Every field checked above: fill the frozen instance directly, as its generated
        # __init__ would (which pays object.__setattr__ per field, on every row read).
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @property
    def released(self) -> bool:
        """Nothing was sent and nobody holds it: the namespace's next request runs it again.

        What an operation becomes when every attempt was certainly not sent (a transient
        failure is not stored), or when its worker died before sending (abandoned).
        """
        return self.state is State.IN_PROGRESS and not self.possibly_sent and not self.lease_owner

    def to_dict(self) -> dict[str, Any]:
        return json_ready(self)


@dataclass(frozen=True, kw_only=True)
class EventRecord:
    tenant_id: str
    id: str
    operation_id: str
    kind: str
    actor: str
    from_state: str | None
    to_state: str | None
    version: int | None
    detail: Mapping[str, Any] | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> EventRecord:
        values = {name: row[name] for name in _EVENT_COLUMNS}
        problem = _problem(values, _EVENT_SHAPE)
        if problem is not None:
            raise _corrupt(values, values["operation_id"], f"event {values['id']}: {problem}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return json_ready(self)


@dataclass(frozen=True, kw_only=True)
class ClaimResult:
    """The outcome of a claim: a new operation, or the one already in the namespace."""

    operation: OperationRecord
    created: bool
    replayed: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)
    # The namespace holds a released operation (nothing sent): the claim may run it again.
    released: bool = False


# -- redaction ------------------------------------------------------------------------------

REDACTED = "[redacted]"
# Texts from _MIN_WHOLE characters match as a whole value anywhere, from _MIN_TEXT inside
# text too; shorter ones, and numbers under _MIN_DIGITS digits, only under a sensitive name.
_MIN_TEXT = 4
_MIN_WHOLE = 3
_MIN_DIGITS = 8
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


@dataclass(frozen=True, kw_only=True)
class Redactor:
    """Replaces sensitive values (and values under sensitive names) with ``[redacted]``.

    ``keys``: the sensitive names (a value under one goes, whatever it is); ``values`` and
    ``numbers``: the sensitive texts and numbers hidden anywhere; ``short_texts`` and
    ``short_numbers``: the others, hidden only under a key that names a sensitive field."""

    keys: frozenset[str] = frozenset()
    values: frozenset[str] = frozenset()
    numbers: frozenset[int | float] = frozenset()
    short_texts: frozenset[str] = frozenset()
    short_numbers: frozenset[int | float] = frozenset()

    @classmethod
    def for_request(cls, names: Iterable[str], sensitive: Any) -> Redactor:
        """From the sensitive field ``names`` and their values (``sensitive``: the values,
        any JSON), before anything is stored. The keys inside an object or list among the
        values are sensitive names too."""
        found = _Found(keys=set(names))
        found.hidden(sensitive)
        return found.redactor()

    @classmethod
    def of(
        cls, stored: Mapping[str, Any] | None, payload: Mapping[str, Any] | None = None
    ) -> Redactor:
        """From an operation's stored (redacted) request and, when in hand, its full request.

        Every place the stored request says ``[redacted]`` names a key; the full request's
        value at that place (when given) is a sensitive value, and the keys inside it (an
        object or a list) are sensitive names.
        """
        found = _Found(keys=set())

        def walk(kept: Any, full: Any, key: str | None) -> None:
            if isinstance(kept, str) and kept == REDACTED:
                if key is not None:
                    found.keys.add(key)
                found.hidden(full)
            elif isinstance(kept, Mapping):
                for k, v in kept.items():
                    walk(v, full.get(k) if isinstance(full, Mapping) else None, str(k))
            elif isinstance(kept, list):
                # A redacted element hides its whole list's name: the echo may be reordered.
                for i, v in enumerate(kept):
                    inner = full[i] if isinstance(full, list) and i < len(full) else None
                    walk(v, inner, key)

        walk(stored or {}, payload, None)
        return found.redactor()

    @staticmethod
    def redacted_at(stored: Mapping[str, Any] | None) -> str | None:
        """Where a stored request differs from the one sent, or None if it is that request.

        The path (``metadata.card``, ``lines[1].text``) of the first ``[redacted]`` at any
        depth: a whole value, a part of a text, or a key; ``"the whole request"`` if none is
        stored. Only a request this answers None for may be sent again from the store.
        """
        if stored is None:
            return "the whole request"
        return _placeholder(stored, "")

    def __bool__(self) -> bool:  # asked on every write of an answer: no generator
        return any((self.keys, self.values, self.numbers, self.short_texts, self.short_numbers))

    @functools.cached_property
    def _named(self) -> tuple[tuple[str, ...], ...]:
        return tuple(words for key in self.keys if (words := _words(key)))

    def sensitive_name(self, key: str) -> bool:
        """Whether ``key`` names a sensitive field: it is one, or holds one's words in order
        (``card_exp_month`` and ``expMonth`` for ``exp_month``)."""
        if key in self.keys:
            return True
        words = _words(key)
        return any(
            words[i : i + len(named)] == named
            for named in self._named
            for i in range(len(words) - len(named) + 1)
        )

    def json(self, value: Any) -> Any:
        """A copy of ``value`` (any JSON) with every sensitive value replaced."""
        if not self:
            return value
        return self._json(value, None)

    def _json(self, value: Any, key: str | None) -> Any:
        if isinstance(value, Mapping):
            out: dict[Any, Any] = {}
            for k, v in value.items():
                name = self.text(k) if isinstance(k, str) else k
                while name in out:  # two keys redacted alike: keep both entries
                    name = f"{name}+"
                under = str(k)
                out[name] = REDACTED if k in self.keys and v is not None else self._json(v, under)
            return out
        if isinstance(value, (list, tuple)):
            # An element sits under its list's name (a list of expiry months is one).
            return [self._json(v, key) for v in value]
        return self._scalar(value, key)

    def _scalar(self, value: Any, key: str | None) -> Any:
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, str):
            if value in self.short_texts and key is not None and self.sensitive_name(key):
                return REDACTED
            return self.text(value)
        if isinstance(value, (int, float)):
            if value in self.numbers:  # as long as a card number: that number, anywhere
                return REDACTED
            # A small number equal to a sensitive one is the same number only under its name.
            if value in self.short_numbers and key is not None and self.sensitive_name(key):
                return REDACTED
        return value

    def text(self, value: str, *, truncated: bool = False) -> str:
        """``value`` with every sensitive value of ``_MIN_TEXT`` or more characters in it
        replaced, or ``[redacted]`` if it is one of three or more; ``truncated``: the text was
        cut, so a sensitive value may end it half-way (that prefix goes too). Shorter values
        are left: out of context they are noise."""
        if value in self.values:
            return REDACTED
        for secret in self.values:
            if len(secret) >= _MIN_TEXT and secret in value:
                value = value.replace(secret, REDACTED)
        if truncated:
            for secret in self.values:
                for cut in range(len(secret) - 1, _MIN_TEXT - 1, -1):
                    if value.endswith(secret[:cut]):
                        value = value[: len(value) - cut] + REDACTED
                        break
        return value

    def answer(self, answer: Answer) -> Answer:
        """``answer`` with its provider text redacted: what its evidence and outcome store.

        The kind, reference and timings are payorch's reading of it and stay as they are.
        """
        if not self:
            return answer
        return replace(
            answer,
            body=self.json(dict(answer.body)) if answer.body is not None else None,
            raw=self.text(answer.raw, truncated=True) if answer.raw is not None else None,
            message=self.text(answer.message) if answer.message is not None else None,
            code=self.text(answer.code) if answer.code is not None else None,
        )


def _words(name: str) -> tuple[str, ...]:
    """A key's words, lower-cased: ``card_exp_month`` and ``cardExpMonth`` alike."""
    return tuple(w.lower() for w in _WORDS.findall(name))


def _placeholder(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return (path or "the request") if REDACTED in value else None
    if isinstance(value, Mapping):
        for k, v in value.items():
            here = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and REDACTED in k:
                return f"{here} (a key)"
            found = _placeholder(v, here)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _placeholder(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif value is not None and not isinstance(value, bool):
        yield value


def _inner_keys(value: Any) -> Iterator[str]:
    """Every key of every object inside ``value``, at any depth."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield str(k)
            yield from _inner_keys(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _inner_keys(v)


@dataclass
class _Found:
    """The sensitive names and values gathered while a :class:`Redactor` is built."""

    keys: set[str]
    values: set[str] = field(default_factory=set)
    numbers: set[int | float] = field(default_factory=set)
    short_texts: set[str] = field(default_factory=set)
    short_numbers: set[int | float] = field(default_factory=set)

    def hidden(self, value: Any) -> None:
        """``value`` is hidden whole: its keys are sensitive names, its scalars values."""
        self.keys.update(_inner_keys(value))
        for leaf in _leaves(value):
            self.add(leaf)

    def add(self, leaf: Any) -> None:
        if isinstance(leaf, str) and leaf and leaf != REDACTED:
            # Digits alone are a number's text (a year "2030"): they follow the number rule.
            digits = leaf.isascii() and leaf.isdigit()
            if len(leaf) < _MIN_WHOLE or (digits and len(leaf) < _MIN_DIGITS):
                self.short_texts.add(leaf)
                if digits:
                    self.short_numbers.add(int(leaf))
            else:
                self.values.add(leaf)
        elif isinstance(leaf, (int, float)):
            # Echoed as text too, e.g. in string-only metadata.
            text = str(leaf) if isinstance(leaf, int) else repr(leaf)
            long = sum(c.isdigit() for c in text) >= _MIN_DIGITS
            (self.numbers if long else self.short_numbers).add(leaf)
            (self.values if long else self.short_texts).add(text)

    def redactor(self) -> Redactor:
        if not any(vars(self).values()):
            return _NO_SECRETS  # nothing sensitive (the common case): one shared instance
        return Redactor(**{name: frozenset(found) for name, found in vars(self).items()})


_NO_SECRETS = Redactor()
