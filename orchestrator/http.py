"""The HTTP contract in one place: framework-free, pure, no I/O.

The FastAPI and Django integrations (and any hand-written endpoint) do three things with it:
read the key with :func:`parse_idempotency_key` (and the body with :func:`parse_json_body`),
call ``execute()``, and send what :func:`http_answer` (or :func:`webhook_answer`) returns.
``../docs/http.md`` has the whole table; in short, every answer says what the client does
next, and none invites a new key: a decline is the key's final answer, and every 503 means
"retry the same key":

=============================================  ======  =========================================
situation                                      status  next step
=============================================  ======  =========================================
succeeded (first time or replayed)             200/201 ``Idempotent-Replayed: true`` on a replay
declined / failed_final                        402     the stored failure, replayed alike
nothing sent (every attempt refused before     503     ``retry: same_key`` after ``Retry-After``;
it reached the provider)                               the key runs again, nothing was stored
outcome_unknown                                202     ``retry: same_key``; ``Location`` to poll
in progress                                    409     ``same_key`` after ``Retry-After``
key reused with other effect fields            422     type ``…:idempotency-key-reused``
request model refused the payload              422     type ``…:request-validation-failed``
key past retention (tombstone)                 410     configurable per operation type
missing/invalid key, body not JSON, bad input  400     fix the request
storage failed (before or after the claim)     503     ``same_key`` after ``Retry-After``;
                                                       ``detail`` says what failed (e.g. the
                                                       schema and the code to align)
=============================================  ======  =========================================

Outcomes are ``application/json`` (the stored body, byte for byte the same on a replay);
every refusal and error is an RFC 9457 ``application/problem+json`` body whose ``type`` is
the error's stable URN, so two 422s are told apart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import http_sf

from .core import MAX_KEY_LENGTH, State, validate_idempotency_key
from .errors import (
    ConfigurationError,
    CorruptRecord,
    DatabaseReadOnly,
    DatabaseUnavailable,
    EffectFailed,
    EffectOutcomeUnknown,
    InvalidIdempotencyKey,
    OperationInProgress,
    OutcomeNotRecorded,
    PayorchError,
    ProviderUnavailable,
    RequestBodyNotJson,
    RequestValidationFailed,
    SchemaNotReady,
    StorageError,
    SyncStandbyUnavailable,
    UnknownProvider,
)
from .outcome import Outcome

if TYPE_CHECKING:  # only the type: answering a webhook needs neither the store nor SQL
    from .outcome import WebhookDelivery, WebhookResult

__all__ = [
    "IDEMPOTENCY_KEY_HEADER",
    "JSON",
    "NEW_KEY",
    "OPERATION_HEADER",
    "PROBLEM_JSON",
    "REPLAYED_HEADER",
    "SAME_KEY",
    "HttpAnswer",
    "http_answer",
    "parse_idempotency_key",
    "parse_json_body",
    "problem",
    "webhook_answer",
]

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
OPERATION_HEADER = "Payorch-Operation-Id"
REPLAYED_HEADER = "Idempotent-Replayed"
JSON = "application/json"
PROBLEM_JSON = "application/problem+json"
TEXT = "text/plain; charset=utf-8"
SAME_KEY = "same_key"
NEW_KEY = "new_key"  # no answer carries it any more (every 503 is same_key); kept for callers
# When a stored outcome says 503 without a Retry-After of its own: its inline retries
# already waited, so a client should not come straight back.
FAILED_NOT_SENT_RETRY_AFTER = 5
# The longest header value that can still hold a valid key: every character escaped, quoted.
_MAX_FIELD = 2 * MAX_KEY_LENGTH + 2

_SAME_KEY_LATER = (
    "retry with the same idempotency key after Retry-After seconds, never with a new one"
)
# What an operator can act on, by the kind of storage failure; never the database's own
# text (hosts, SQL, a URL's credentials): that stays on the exception, for the logs.
_STORAGE_DETAILS: tuple[tuple[type[StorageError], str], ...] = (
    (
        SchemaNotReady,
        # Neutral: the client cannot tell an older schema (upgrade) from a newer one (roll
        # the code forward); the message, for the logs, says which.
        "payorch's tables do not match this release: an operator must align the schema and "
        "the code (`payorch db upgrade`, or roll the code forward); nothing was written; "
        f"{_SAME_KEY_LATER}",
    ),
    (
        DatabaseReadOnly,
        "the database refuses writes (a standby or a read-only session): payorch must be "
        f"pointed at the primary; nothing was written; {_SAME_KEY_LATER}",
    ),
    (
        SyncStandbyUnavailable,
        "no synchronous standby is streaming, which this service requires before it claims "
        f"a key; nothing was written; {_SAME_KEY_LATER}",
    ),
    (
        DatabaseUnavailable,
        "the database could not be reached (down, refusing connections, a connection lost, "
        f"or none free in the pool); nothing was written; {_SAME_KEY_LATER}",
    ),
    (
        CorruptRecord,
        "a stored record of this operation cannot be read and is set aside for an operator "
        f"to repair; {_SAME_KEY_LATER}",
    ),
)
_STORAGE_DETAIL = f"the database failed the request; nothing was written; {_SAME_KEY_LATER}"
_NOT_RECORDED_DETAIL = (
    "the operation may exist and may have reached the provider, but its outcome is not "
    "recorded yet; retry with the same idempotency key after Retry-After seconds, never "
    "with a new one"
)
_NOT_SENT_DETAIL = (
    "the provider could not be reached and no request was sent, so nothing was charged; "
    "retry with the same idempotency key after Retry-After seconds, never with a new one"
)
_INTERNAL_DETAIL = (
    "the server failed to handle the request; retry with the same idempotency key later, "
    "never with a new one"
)
_UNKNOWN_MESSAGE = (
    "the provider's answer is not known yet; it is being reconciled, "
    "ask again with the same idempotency key"
)
_ACRONYMS = {"json": "JSON"}


@dataclass(frozen=True, kw_only=True)
class HttpAnswer:
    """Status, headers and body to send; ``content_type`` is not repeated in ``headers``."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = JSON
    # A plain-text body instead of ``body`` (a provider's acknowledgement, e.g. "[accepted]").
    text: str | None = None

    def content(self) -> bytes:
        """The body as compact JSON (ASCII: anything stored, even a lone surrogate, encodes)."""
        if self.text is not None:
            return self.text.encode("utf-8")
        return json.dumps(self.body, separators=(",", ":"), ensure_ascii=True).encode("ascii")


# -- the Idempotency-Key header ----------------------------------------------------------


def _bad_key(detail: str) -> InvalidIdempotencyKey:
    return InvalidIdempotencyKey(f"the {IDEMPOTENCY_KEY_HEADER} header {detail}")


def parse_idempotency_key(value: str | None) -> str:
    """The key an ``Idempotency-Key`` header value carries, or ``InvalidIdempotencyKey``.

    Two forms name one key: the draft's RFC 8941 sf-string (``"8e03…"``, with ``\\"`` and
    ``\\\\`` escapes) and the bare form Stripe clients send (``8e03…``), taken verbatim
    (never read as a token, integer or byte sequence: UUIDs often start with a digit).
    Refused: missing, empty, over-long, list-valued (``a, b``), non-ASCII or control
    characters, whitespace inside, parameters (``"k";p=1``: the draft defines none) and bad
    quoting. The key then passes payorch's own rule (``validate_idempotency_key``), the same
    one ``execute()`` applies: 1-255 printable ASCII characters, no spaces.
    """
    if value is None:
        raise _bad_key("is missing")
    text = value.strip(" \t")  # optional whitespace around a field value is not part of it
    if not text:
        raise _bad_key("is empty")
    if len(text) > _MAX_FIELD:
        raise _bad_key(f"is too long (a key has at most {MAX_KEY_LENGTH} characters)")
    if not text.isascii():
        raise _bad_key("must be ASCII")
    if any((c < " " and c != "\t") or c == "\x7f" for c in text):
        raise _bad_key("contains control characters")
    key = _quoted(text) if text.startswith('"') else _bare(text)
    return validate_idempotency_key(key)


def _quoted(text: str) -> str:
    data = text.encode("ascii")
    try:
        members = http_sf.parse(data, tltype="list")
    except http_sf.StructuredFieldError:
        members = None
    if isinstance(members, list) and len(members) > 1:
        raise _bad_key("holds several values (a list); send exactly one key")
    try:
        parsed = http_sf.parse(data, tltype="item")
    except http_sf.StructuredFieldError as exc:
        raise _bad_key(f"is badly quoted: {exc}") from None
    if not isinstance(parsed, tuple):  # an item is (value, parameters)
        raise _bad_key("must be one quoted string")
    item, params = parsed
    if not isinstance(item, str):  # e.g. a display string %"…"
        raise _bad_key("must be a quoted string or a bare key")
    if params:
        raise _bad_key(f"has parameters ({', '.join(sorted(params))}); none are accepted")
    return item


def _bare(text: str) -> str:
    if "," in text:
        raise _bad_key("holds several values (a list); send exactly one key")
    if '"' in text:
        raise _bad_key("is badly quoted: a quoted key must start and end with '\"'")
    if " " in text or "\t" in text:
        raise _bad_key("contains whitespace; a key has none")
    return text


# -- the request body --------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for name, value in pairs:
        if name in obj:  # parsers disagree on which one wins: refuse rather than pick
            raise RequestBodyNotJson(f"the request body repeats the member {name!r}")
        obj[name] = value
    return obj


def _no_constant(name: str) -> Any:
    raise RequestBodyNotJson(f"the request body holds {name}, which is not JSON")


def parse_json_body(raw: bytes | str) -> dict[str, Any]:
    """The request body as a JSON object, or ``RequestBodyNotJson`` (400).

    Strict RFC 8259: UTF-8 only, no NaN/Infinity, no repeated member names. Valid JSON that
    is not an object is ``RequestValidationFailed`` (422), as the request model would say.
    Nothing is written either way.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise RequestBodyNotJson("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise RequestBodyNotJson(f"the request body is not JSON: {exc.msg}") from None
    except RecursionError:
        raise RequestBodyNotJson("the request body is nested too deeply") from None
    if not isinstance(value, dict):
        raise RequestValidationFailed(
            "the request body must be a JSON object",
            errors=[{"loc": [], "msg": "must be a JSON object", "type": "model_type"}],
        )
    return value


# -- answers -------------------------------------------------------------------------------


def _seconds(value: float) -> str:
    return str(max(1, math.ceil(value)))


def _title(problem_type: str) -> str:
    words = problem_type.rsplit(":", 1)[-1].split("-")
    text = " ".join(_ACRONYMS.get(w, w) for w in words)
    return text[:1].upper() + text[1:]


def problem(
    status: int,
    type_: str,
    title: str,
    detail: str,
    *,
    headers: Mapping[str, str] | None = None,
    **ext: Any,
) -> HttpAnswer:
    """An RFC 9457 problem answer; ``ext`` become extension members of the body.

    Every 409 and 503 says when to come back: ``Retry-After: 1`` unless ``headers`` has one.
    """
    out = dict(headers or {})
    if status in (409, 503):
        out.setdefault("Retry-After", "1")
    body = {"type": type_, "title": title, "status": status, "detail": detail, **ext}
    return HttpAnswer(status=status, body=body, headers=out, content_type=PROBLEM_JSON)


def _error_answer(err: PayorchError, *, status: int | None = None) -> HttpAnswer:
    status = status or err.http_status
    headers: dict[str, str] = {}
    ext: dict[str, Any] = {}
    detail = err.message
    if err.operation_id is not None:
        headers[OPERATION_HEADER] = err.operation_id
        ext["operation_id"] = err.operation_id
    if isinstance(err, RequestValidationFailed):
        ext["errors"] = err.errors
    if isinstance(err, OperationInProgress | EffectOutcomeUnknown):
        # In progress, or an effect that may have happened (202, escalated): the same key,
        # later.
        headers["Retry-After"] = _seconds(err.retry_after)
        ext["retry"] = SAME_KEY
    elif isinstance(err, EffectFailed):
        ext["error_type"] = err.error_type
    elif isinstance(err, StorageError):
        # Never the database's own text (hosts, SQL) to a client; it stays on the exception.
        detail = _storage_detail(err)
        headers["Retry-After"] = _seconds(err.retry_after)
        ext["retry"] = SAME_KEY
    elif isinstance(err, ProviderUnavailable):
        # Nothing reached the provider and nothing is stored: the same key runs again.
        detail = _NOT_SENT_DETAIL
        headers["Retry-After"] = _seconds(err.retry_after)
        ext["retry"] = SAME_KEY
        if err.code:
            ext["code"] = err.code
    elif status >= 500:
        # Configuration and provider errors may name internals; same key is always safe.
        detail = _INTERNAL_DETAIL
        ext["retry"] = SAME_KEY
    return problem(
        status, err.problem_type, _title(err.problem_type), detail, headers=headers, **ext
    )


def _storage_detail(err: StorageError) -> str:
    if isinstance(err, OutcomeNotRecorded):
        return _NOT_RECORDED_DETAIL
    for kind, detail in _STORAGE_DETAILS:
        if isinstance(err, kind):
            return detail
    return _STORAGE_DETAIL


def _outcome_answer(result: Outcome, success_status: int, location: str | None) -> HttpAnswer:
    headers = {OPERATION_HEADER: result.operation_id}
    if result.replayed:
        headers[REPLAYED_HEADER] = "true"
    body: dict[str, Any] = {
        "operation_id": result.operation_id,
        "state": result.state.value,
        **{k: v for k, v in (result.response or {}).items() if k != "http_status"},
    }
    if result.routed:
        body["provider"] = result.provider  # the one answer names the provider it came from
    status = result.http_status
    if result.state is State.SUCCEEDED and status == 200:
        status = success_status  # a replay answers as the first time did
    if result.state is State.IN_PROGRESS:
        # Taken over mid-call (our lease lapsed): someone else is finishing it.
        headers["Retry-After"] = "1"
        body["retry"] = SAME_KEY
    if result.unknown:
        body["message"] = _UNKNOWN_MESSAGE
        body["retry"] = SAME_KEY
    if status == 503 and result.state is State.FAILED_FINAL:
        # A "nothing sent" failure stored before such failures were released (or by a node
        # of the earlier version during a rolling upgrade). Its client was told to use a new
        # key and may have paid under it: this key stays closed, a final failure like a
        # decline (nothing was charged under it), never a 503 that would loop for ever.
        status = 402
    elif status == 503:
        headers["Retry-After"] = str(FAILED_NOT_SENT_RETRY_AFTER)
        body["retry"] = SAME_KEY
    if location is not None and status in (201, 202):
        headers["Location"] = location  # the created operation / where to poll it
    return HttpAnswer(status=status, body=body, headers=headers, content_type=JSON)


def http_answer(
    result: Outcome | PayorchError, *, success_status: int = 200, location: str | None = None
) -> HttpAnswer:
    """What to send back for ``execute()``'s outcome or the PayorchError it raised.

    ``success_status`` (200 or 201) answers a succeeded operation, fresh or replayed alike.
    ``location`` (the URL where the integration serves the operation) goes out as
    ``Location`` on a 202 (where to poll) or a 201.
    """
    if success_status not in (200, 201):
        raise ConfigurationError(f"success_status must be 200 or 201, not {success_status}")
    if isinstance(result, PayorchError):
        return _error_answer(result)
    return _outcome_answer(result, success_status, location)


def webhook_answer(result: WebhookResult | WebhookDelivery | PayorchError) -> HttpAnswer:
    """What to send back to a provider for ``WebhookHandler.handle()``'s result or error.

    Every handled delivery is 200, whatever became of it, so the provider stops re-sending;
    a bad signature or shape is 400, an unknown provider in the URL 404 (its path names no
    endpoint), and storage trouble 503 with ``Retry-After`` so the provider sends it again.
    """
    if isinstance(result, UnknownProvider):
        return _error_answer(result, status=404)
    if isinstance(result, PayorchError):
        return _error_answer(result)
    if not hasattr(result, "status"):
        return _delivery_answer(result)
    result = cast("WebhookResult", result)
    body: dict[str, Any] = {"status": result.status.value, "event_id": result.event_id}
    headers: dict[str, str] = {}
    if result.operation_id is not None:
        body["operation_id"] = result.operation_id
        headers[OPERATION_HEADER] = result.operation_id
    if result.state is not None:
        body["state"] = result.state.value
    return HttpAnswer(status=200, body=body, headers=headers, content_type=JSON)


def _delivery_answer(delivery: WebhookDelivery) -> HttpAnswer:
    """A batched delivery: every item taken, or the first refusal (so the provider retries)."""
    if delivery.rejected:
        index, first = delivery.rejected[0]
        answer = _error_answer(first)
        answer.body["refused_items"] = [i for i, _ in delivery.rejected]
        answer.body["taken_items"] = len(delivery.results)
        answer.body["detail"] = f"item {index}: {first.message}"
        return answer
    if delivery.acknowledgement is not None:
        return HttpAnswer(status=200, body={}, content_type=TEXT, text=delivery.acknowledgement)
    if len(delivery.results) == 1:
        return webhook_answer(delivery.results[0])
    items = [
        {
            k: v
            for k, v in (
                ("status", r.status.value),
                ("event_id", r.event_id),
                ("operation_id", r.operation_id),
                ("state", r.state.value if r.state is not None else None),
            )
            if v is not None
        }
        for r in delivery.results
    ]
    return HttpAnswer(status=200, body={"results": items}, content_type=JSON)
