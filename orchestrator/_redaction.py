"""Redaction: a sensitive request value is stored nowhere, even where a provider echoes it.

One function decides what every stored copy of provider text looks like (the stored
response, event details via :meth:`Redactor.answer`, webhook inbox bodies): a
:class:`Redactor` built from an operation's request.

- While the full request is in hand (``execute()``), the sensitive *values* are known: any
  string equal to one, anywhere in the JSON (keys included), becomes ``[redacted]``, and so
  does any occurrence inside a longer string (a message quoting it, a truncated raw body).
- Afterwards (status queries, webhooks) only the stored request is left, in which those
  values are already ``[redacted]``: the *names* under which they sat are known, so a value
  under such a key, anywhere in a provider body, becomes ``[redacted]``. Providers echo
  fields under the names they were sent with (``metadata[note]`` comes back as
  ``metadata.note``), so the echo is caught without keeping the value.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .provider import Answer

__all__ = ["REDACTED", "Redactor"]

REDACTED = "[redacted]"
# Shorter values are redacted only where a whole string equals them: replacing "42" inside
# every text would garble the evidence and hide nothing worth hiding.
_MIN_INNER = 4


@dataclass(frozen=True, kw_only=True)
class Redactor:
    """Replaces sensitive values (and values under sensitive names) with ``[redacted]``."""

    keys: frozenset[str] = frozenset()
    values: frozenset[str] = frozenset()
    numbers: frozenset[int] = frozenset()

    @classmethod
    def for_request(cls, names: Iterable[str], sensitive: Any) -> Redactor:
        """From the sensitive field ``names`` and their values (``sensitive``: the values,
        any JSON), before anything is stored."""
        values: set[str] = set()
        numbers: set[int] = set()
        for leaf in _leaves(sensitive):
            _add(leaf, values, numbers)
        return cls(keys=frozenset(names), values=frozenset(values), numbers=frozenset(numbers))

    @classmethod
    def of(
        cls, stored: Mapping[str, Any] | None, payload: Mapping[str, Any] | None = None
    ) -> Redactor:
        """From an operation's stored (redacted) request and, when in hand, its full request.

        Every place the stored request says ``[redacted]`` names a key; the full request's
        value at that place (when given) is a sensitive value.
        """
        keys: set[str] = set()
        values: set[str] = set()
        numbers: set[int] = set()

        def walk(kept: Any, full: Any, key: str | None) -> None:
            if isinstance(kept, str) and kept == REDACTED:
                if key is not None:
                    keys.add(key)
                for leaf in _leaves(full):
                    _add(leaf, values, numbers)
            elif isinstance(kept, Mapping):
                for k, v in kept.items():
                    walk(v, full.get(k) if isinstance(full, Mapping) else None, str(k))
            elif isinstance(kept, list):
                # A redacted element hides its whole list's name: the echo may be reordered.
                for i, v in enumerate(kept):
                    inner = full[i] if isinstance(full, list) and i < len(full) else None
                    walk(v, inner, key)

        walk(stored or {}, payload, None)
        return cls(keys=frozenset(keys), values=frozenset(values), numbers=frozenset(numbers))

    def __bool__(self) -> bool:
        return bool(self.keys or self.values or self.numbers)

    def json(self, value: Any) -> Any:
        """A copy of ``value`` (any JSON) with every sensitive value replaced."""
        if not self:
            return value
        if isinstance(value, Mapping):
            out: dict[Any, Any] = {}
            for k, v in value.items():
                name = self.text(k) if isinstance(k, str) else k
                while name in out:  # two keys redacted alike: keep both entries
                    name = f"{name}+"
                out[name] = REDACTED if k in self.keys and v is not None else self.json(v)
            return out
        if isinstance(value, (list, tuple)):
            return [self.json(v) for v in value]
        return self._scalar(value)

    def _scalar(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return REDACTED if value in self.numbers else value
        if isinstance(value, float):
            return REDACTED if repr(value) in self.values else value
        return value

    def text(self, value: str, *, truncated: bool = False) -> str:
        """``value`` with every sensitive value in it replaced; ``truncated``: the text was
        cut, so a sensitive value may end it half-way (that prefix goes too)."""
        if value in self.values:
            return REDACTED
        for secret in self.values:
            if len(secret) >= _MIN_INNER and secret in value:
                value = value.replace(secret, REDACTED)
        if truncated:
            for secret in self.values:
                for cut in range(len(secret) - 1, _MIN_INNER - 1, -1):
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


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif value is not None and not isinstance(value, bool):
        yield value


def _add(leaf: Any, values: set[str], numbers: set[int]) -> None:
    if isinstance(leaf, str):
        if leaf and leaf != REDACTED:
            values.add(leaf)
    elif isinstance(leaf, int):
        numbers.add(leaf)
        values.add(str(leaf))  # echoed as text, e.g. in string-only metadata
    elif isinstance(leaf, float):
        values.add(repr(leaf))
