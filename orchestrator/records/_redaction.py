"""**Redaction** (:class:`Redactor`): a sensitive request value is stored nowhere, even where a
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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..provider import Answer

__all__ = ["REDACTED", "Redactor"]


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
