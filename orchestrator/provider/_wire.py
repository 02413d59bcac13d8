"""What a submission put on the wire, kept so that a re-send is that request, byte for byte.

A replay inside the provider's idempotency window (or a re-submission after "not found")
is safe only if it is the identical request under the same key: the provider then answers
the first outcome. A request rebuilt later from the stored payload is identical only if the
adapter is configured as it was (an Adyen ``return_url``, a merchant account, a default
currency): a daemon built from other settings would send another request, which the
provider refuses or, worse, executes as the first. So an adapter that can (a
:class:`payorch.provider.Resender`) says what it would send, before the claim; the claim
keeps it with the operation (its ``claimed`` event), and a re-send hands it back to the adapter's
``submit`` (:attr:`SubmitRequest.wire <payorch.provider.SubmitRequest.wire>`), which
sends it as it is. Credentials and tracing headers are the sender's own; the method, the
URL, the headers that decide the request (``Idempotency-Key``, ``Content-Type`` and what
the adapter names) and the body are kept. A re-sending adapter whose base URL is not where
the request went first (another endpoint, API version or region) sends nothing: the same
bytes there would be another request. An adapter that authenticates by a query parameter
must not be a ``Resender``: the URL is kept as sent.

A request whose stored copy hides a sensitive value keeps no wire request either: a
re-send would need what was not stored, so none happens (the reconciler escalates).
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from ..errors import ConfigurationError

__all__ = ["DECIDING_HEADERS", "WireRequest"]

# Headers that decide what the provider does with a request (the others are credentials,
# tracing or transport, which the sender supplies afresh).
DECIDING_HEADERS = frozenset({"idempotency-key", "content-type"})


@dataclass(frozen=True, kw_only=True)
class WireRequest:
    """One HTTP request as an adapter sent it (see the module's docstring)."""

    method: str
    url: str  # as sent, query included
    headers: tuple[tuple[str, str], ...]  # the deciding ones, as sent
    body: bytes

    @classmethod
    def of(cls, request: httpx.Request, *, keep: Iterable[str] = DECIDING_HEADERS) -> WireRequest:
        """The wire form of ``request``: its ``keep`` headers (by name, any case) and the rest."""
        kept = {name.lower() for name in keep}
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() in kept)
        return cls(
            method=request.method, url=str(request.url), headers=headers, body=request.read()
        )

    @property
    def idempotency_key(self) -> str | None:
        """The ``Idempotency-Key`` it was sent with, if it carries one."""
        return next((v for k, v in self.headers if k.lower() == "idempotency-key"), None)

    def build(
        self,
        client: httpx.Client | httpx.AsyncClient,
        *,
        base_url: str,
        headers: Mapping[str, str],
        timeout: Any,
    ) -> httpx.Request:
        """The request to send again: this one's method, URL, deciding headers and body,
        with the sender's own credentials and tracing ``headers`` beside them.

        Raises ``ConfigurationError`` (nothing sent) when the sender's ``base_url`` is not
        where it went first (another endpoint, API version or region): the same bytes there
        are another request."""
        base = _normalised(base_url)
        if not self.url.startswith(base + "/") and self.url != base:
            raise ConfigurationError(
                f"the request was first sent to {self.url}, not under this adapter's "
                f"{base}: not re-sent; configure the adapter as the app's (PAYORCH_PROVIDERS)"
            )
        merged = dict(headers)
        merged.update(self.headers)
        return client.build_request(
            self.method, self.url, content=self.body, headers=merged, timeout=timeout
        )

    def stored(self) -> dict[str, Any]:
        """A JSON-able form (text bodies as text, others in base64)."""
        out: dict[str, Any] = {
            "method": self.method,
            "url": self.url,
            "headers": [list(h) for h in self.headers],
        }
        try:
            out["body"] = self.body.decode("utf-8")
        except UnicodeDecodeError:
            out["body_base64"] = base64.b64encode(self.body).decode("ascii")
        return out

    @classmethod
    def from_stored(cls, data: object) -> WireRequest | None:
        """The request :meth:`stored` wrote, or None for anything else (never a guess)."""
        if not isinstance(data, Mapping):
            return None
        method, url, headers = data.get("method"), data.get("url"), data.get("headers")
        if not (isinstance(method, str) and isinstance(url, str) and isinstance(headers, list)):
            return None
        pairs = []
        for h in headers:
            if not (isinstance(h, list) and len(h) == 2 and all(isinstance(p, str) for p in h)):
                return None
            pairs.append((h[0], h[1]))
        body: bytes
        if isinstance(data.get("body"), str):
            body = data["body"].encode("utf-8")
        elif isinstance(data.get("body_base64"), str):
            try:
                body = base64.b64decode(data["body_base64"], validate=True)
            except (binascii.Error, ValueError):
                return None
        else:
            return None
        return cls(method=method, url=url, headers=tuple(pairs), body=body)


@functools.lru_cache(maxsize=64)
def _normalised(base_url: str) -> str:
    """``base_url`` as httpx spells it, without a trailing slash (an adapter has one: parsed
    once, not per request)."""
    return str(httpx.URL(base_url)).rstrip("/")
