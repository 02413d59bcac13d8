"""The outbox's Redis Streams sink, and a small consumer-group reader (``payorch[redis]``).

:class:`RedisStreamSink` appends each message to a stream (by default one per tenant and
aggregate type, ``payorch:{tenant_id}:{aggregate_type}``), so the messages of one aggregate
keep the order the relay delivers them in. Publication is idempotent within a window: one
Lua script, atomic on the server, looks for the message's dedupe key, appends with
``XADD`` only if it is absent, and then sets it (with the stream entry's id) for
``dedupe_window``. A relay that re-sends after a crash or a lost reply therefore appends
nothing the second time, as long as the re-send comes within the window.

Redis answers once the entry is in memory, not on disk: a crash of the Redis host loses
what came after the last snapshot, or with ``appendonly yes`` and ``appendfsync everysec``
up to about a second of acknowledged entries (``appendfsync always`` closes that gap, at a
cost). The dedupe keys live in the same memory: such a crash loses both, and a later
re-send appends again.

:class:`RedisStreamReader` reads a stream through a consumer group: its own unacknowledged
entries first, then new ones; :meth:`RedisStreamReader.ack` after processing. So a consumer
that crashes before acking gets the entry again (at least once): dedupe on ``id``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, timedelta
from typing import Any

from ..errors import ConfigurationError, DeliveryFailed
from ._sinks import OutboxMessage

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise ConfigurationError("payorch.outbox.redis needs redis-py: install payorch[redis]") from exc

__all__ = [
    "DEFAULT_STREAM",
    "FIELDS",
    "RedisStreamReader",
    "RedisStreamSink",
    "StreamEntry",
    "dedupe_key",
    "entry_fields",
]

DEFAULT_STREAM = "payorch:{tenant_id}:{aggregate_type}"
# What each entry holds (all strings; ``payload`` is JSON, ``operation_id`` may be empty).
FIELDS = (
    "id",
    "type",
    "tenant_id",
    "aggregate_type",
    "aggregate_id",
    "payload",
    "operation_id",
    "created_at",
)
_TEMPLATE_FIELDS = ("tenant_id", "aggregate_type", "aggregate_id", "type", "destination")
_ERROR_TEXT = 200  # characters of a Redis error kept in the failure's reason
_TRIES = 2  # per delivery, by a client built here (see _client)

# The dedupe key is read first and set only after XADD succeeded: a script stops at the
# first failing command without undoing the ones before it, so setting the key first could
# leave a key with no entry, and every re-send would then be dropped as a duplicate.
_PUBLISH = """
local seen = redis.call('GET', KEYS[2])
if seen then
  return {seen, 0}
end
local xadd = {'XADD', KEYS[1]}
if tonumber(ARGV[2]) > 0 then
  table.insert(xadd, 'MAXLEN')
  table.insert(xadd, '~')
  table.insert(xadd, ARGV[2])
end
table.insert(xadd, '*')
for i = 3, #ARGV do
  table.insert(xadd, ARGV[i])
end
local id = redis.call(unpack(xadd))
redis.call('SET', KEYS[2], id, 'PX', ARGV[1])
return {id, 1}
"""


def _text(value: object) -> str:
    """A reply as text, whether the client decodes responses or not."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


Client = redis.Redis | redis.RedisCluster


def _client(
    client_or_url: Client | str, *, socket_timeout: float, connect_timeout: float
) -> tuple[Client, bool]:
    """The client to use, and whether it is ours to close."""
    if isinstance(client_or_url, redis.Redis | redis.RedisCluster):
        return client_or_url, False
    if not isinstance(client_or_url, str):
        raise ConfigurationError(
            "expected a redis.Redis, a redis.RedisCluster or a redis:// URL, not "
            f"{type(client_or_url).__name__}"
        )
    for name, value in (("socket_timeout", socket_timeout), ("connect_timeout", connect_timeout)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigurationError(f"{name} must be a positive number of seconds")
    try:
        client = redis.Redis.from_url(
            client_or_url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            # One immediate retry: a pooled connection broken by a Redis restart is
            # replaced at once, not counted as a failed attempt. More is the relay's job
            # (and a re-run is harmless: publication is idempotent).
            retry=Retry(NoBackoff(), _TRIES - 1),
        )
    except ValueError as exc:  # redis-py's refusal of a malformed URL
        raise ConfigurationError(f"invalid Redis URL: {exc}") from exc
    return client, True


def _has_hash_tag(key: str) -> bool:
    """Whether Redis Cluster would place ``key`` by a ``{tag}`` inside it."""
    start = key.find("{")
    return start >= 0 and key.find("}", start + 2) > start


def dedupe_key(stream: str, message: OutboxMessage) -> str:
    """The key that marks ``message`` as published to ``stream``.

    It shares the stream's hash slot (its hash tag, or the stream's whole name as one), so
    the script's two keys stay on one node of a Redis Cluster.
    """
    tagged = stream if _has_hash_tag(stream) else "{" + stream + "}"
    return f"{tagged}:dedupe:{message.tenant_id}:{message.id}"


def entry_fields(message: OutboxMessage) -> dict[str, str]:
    """The stream entry's fields for ``message`` (see :data:`FIELDS`)."""
    created = message.created_at
    if created.tzinfo is None:  # the store's datetimes are UTC; a naive one is too
        created = created.replace(tzinfo=UTC)
    return {
        "id": message.id,
        "type": message.type,
        "tenant_id": message.tenant_id,
        "aggregate_type": message.aggregate_type,
        "aggregate_id": message.aggregate_id,
        "payload": json.dumps(
            dict(message.payload), separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ),
        "operation_id": message.operation_id or "",
        "created_at": created.astimezone(UTC).isoformat(),
    }


def _stream_namer(stream: str | Callable[[OutboxMessage], str]) -> Callable[[OutboxMessage], str]:
    if callable(stream):
        return stream
    if not isinstance(stream, str) or not stream:
        raise ConfigurationError("stream must be a non-empty template or a function")
    try:  # refuse an unknown placeholder now, not on the first delivery
        stream.format_map(dict.fromkeys(_TEMPLATE_FIELDS, "x"))
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        names = ", ".join("{" + f + "}" for f in _TEMPLATE_FIELDS)
        raise ConfigurationError(f"stream template {stream!r} may name only {names}") from exc

    def name(message: OutboxMessage) -> str:
        return stream.format_map({f: getattr(message, f) for f in _TEMPLATE_FIELDS})

    return name


class RedisStreamSink:
    """A :class:`~payorch.outbox.Sink` that appends each message to a Redis stream.

    ``client_or_url`` is a ``redis.Redis`` or ``redis.RedisCluster`` (the caller's: used,
    never closed) or a ``redis://`` / ``rediss://`` URL (a client built here with
    ``socket_timeout`` and ``connect_timeout``, closed by :meth:`close`). ``stream`` is a
    template over ``tenant_id``, ``aggregate_type``, ``aggregate_id``, ``type`` and
    ``destination``, or a function of the message; keep an aggregate's messages on one
    stream, or their order is lost. A re-send of a message id within ``dedupe_window``
    appends nothing. ``maxlen`` trims each stream to about that many entries (entries no
    group has read yet included).
    Any Redis error is :class:`~payorch.errors.DeliveryFailed`.
    """

    def __init__(
        self,
        client_or_url: Client | str,
        *,
        stream: str | Callable[[OutboxMessage], str] = DEFAULT_STREAM,
        dedupe_window: timedelta = timedelta(days=1),
        maxlen: int | None = None,
        socket_timeout: float = 2.0,
        connect_timeout: float = 1.0,
    ) -> None:
        window_ms = int(dedupe_window.total_seconds() * 1000)
        if window_ms < 1:
            raise ConfigurationError(f"dedupe_window must be positive, not {dedupe_window!r}")
        if maxlen is not None and (isinstance(maxlen, bool) or maxlen < 1):
            raise ConfigurationError(f"maxlen must be a positive integer or None, not {maxlen!r}")
        self._stream_of = _stream_namer(stream)
        self._window_ms = window_ms
        self._maxlen = maxlen or 0
        self._client, self._owns = _client(
            client_or_url, socket_timeout=socket_timeout, connect_timeout=connect_timeout
        )
        self._publish = self._client.register_script(_PUBLISH)
        # A client built here: each try is a connect (if none is pooled) and the script's
        # round trip, each bounded by its time-out; there are two tries at most. (A lease
        # that runs out mid-call only means a second relay re-sends: the window dedupes it.)
        self._deadline = _TRIES * (connect_timeout + socket_timeout) if self._owns else None

    @property
    def client(self) -> Client:
        return self._client

    @property
    def deadline(self) -> float | None:
        """The longest one delivery can take, in seconds, when the client was built here
        (the relay checks that its lease outlasts a batch); None for a caller's client."""
        return self._deadline

    def stream_for(self, message: OutboxMessage) -> str:
        """The stream ``message`` goes to."""
        return self._stream_of(message)

    def publish(self, message: OutboxMessage) -> str:
        """Append ``message`` unless it was appended within the window; return its stream
        entry id (the first one's, for a re-send)."""
        stream = self._stream_of(message)
        try:
            fields = entry_fields(message)
        except (TypeError, ValueError) as exc:
            raise DeliveryFailed(f"payload has no JSON form: {exc}") from exc
        args: list[str | int] = [self._window_ms, self._maxlen]
        for name, value in fields.items():
            args += [name, value]
        try:
            reply = self._publish(keys=[stream, dedupe_key(stream, message)], args=args)
        except redis.RedisError as exc:
            reason = f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT]
            raise DeliveryFailed(f"redis: {reason}") from exc
        return _text(reply[0])

    def deliver(self, message: OutboxMessage) -> None:
        """The :class:`~payorch.outbox.Sink` method: :meth:`publish`, the id dropped."""
        self.publish(message)

    def close(self) -> None:
        """Close the client if it was built here."""
        if self._owns:
            self._client.close()


# -- the consuming side ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One entry read from a stream: its stream ``entry_id`` and the fields the sink wrote
    (see :data:`FIELDS`), as text. ``id`` is the outbox message id: dedupe on it."""

    stream: str
    entry_id: str
    fields: Mapping[str, str]

    @property
    def id(self) -> str:
        return self.fields.get("id", "")

    @property
    def type(self) -> str:
        return self.fields.get("type", "")

    @property
    def tenant_id(self) -> str:
        return self.fields.get("tenant_id", "")

    def payload(self) -> Any:
        """The message's payload, parsed from its JSON."""
        return json.loads(self.fields.get("payload", "null"))


def _entries(stream: str, raw: Iterable[Any]) -> tuple[list[StreamEntry], list[str]]:
    """Readable entries, and the ids of pending ones whose entry was trimmed away."""
    entries: list[StreamEntry] = []
    gone: list[str] = []
    for entry_id, fields in raw:
        if not fields:  # still pending, but MAXLEN trimmed the entry itself
            gone.append(_text(entry_id))
            continue
        decoded = {_text(k): _text(v) for k, v in fields.items()}
        entries.append(StreamEntry(stream, _text(entry_id), decoded))
    return entries, gone


def _stream_reply(reply: Any) -> list[Any]:
    """XREADGROUP's entries for one stream, from a RESP2 list or a RESP3 map."""
    if not reply:
        return []
    if isinstance(reply, dict):
        values = list(reply.values())
        return list(values[0]) if values else []
    return list(reply[0][1])


class RedisStreamReader:
    """Reads one stream through a consumer group, at least once.

    :meth:`read` returns this consumer's delivered-but-unacknowledged entries first (after a
    crash, the same ``consumer`` name gets them back), then new ones; :meth:`ack` each once
    processed. :meth:`claim_idle` takes over entries another consumer left unacknowledged
    for ``min_idle``. Redis errors are let through: they are the caller's to handle. A
    ``block`` must stay below the client's socket time-out (30 s for a client built here).
    """

    def __init__(
        self,
        client_or_url: Client | str,
        *,
        stream: str,
        group: str,
        consumer: str,
        start: str = "0",
        socket_timeout: float = 30.0,
        connect_timeout: float = 2.0,
    ) -> None:
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self._start = start  # where a group created here begins ("0": the whole stream)
        self._client, self._owns = _client(
            client_or_url, socket_timeout=socket_timeout, connect_timeout=connect_timeout
        )
        self._socket_timeout = socket_timeout if self._owns else None

    def ensure_group(self) -> None:
        """Create the group (and the stream) if absent."""
        try:
            self._client.xgroup_create(self.stream, self.group, id=self._start, mkstream=True)
        except redis.ResponseError as exc:
            if not str(exc).startswith("BUSYGROUP"):
                raise

    def read(self, *, count: int = 100, block: timedelta | None = None) -> list[StreamEntry]:
        """Up to ``count`` entries: unacknowledged ones first, else new ones (waiting up to
        ``block`` for one; None: do not wait)."""
        wait = None if block is None else max(1, int(block.total_seconds() * 1000))
        limit = self._socket_timeout
        if wait is not None and limit is not None and wait >= limit * 1000:
            # The blocked read would be cut by the socket's own time-out first.
            raise ConfigurationError("block must be shorter than the reader's socket_timeout")
        pending = self._read("0", count=count, block=None)
        if pending:
            return pending
        return self._read(">", count=count, block=wait)

    def ack(self, *entries: StreamEntry | str) -> int:
        """Acknowledge processed entries (or entry ids); returns how many were pending."""
        ids = [e.entry_id if isinstance(e, StreamEntry) else e for e in entries]
        return int(self._client.xack(self.stream, self.group, *ids)) if ids else 0

    def claim_idle(self, *, min_idle: timedelta, count: int = 100) -> list[StreamEntry]:
        """Take over up to ``count`` entries unacknowledged by anyone for ``min_idle``."""
        reply = self._client.xautoclaim(
            self.stream,
            self.group,
            self.consumer,
            min_idle_time=int(min_idle.total_seconds() * 1000),
            count=count,
        )
        entries, gone = _entries(self.stream, reply[1] if len(reply) > 1 else [])
        if gone:
            self.ack(*gone)
        return entries

    def close(self) -> None:
        if self._owns:
            self._client.close()

    def _read(self, start: str, *, count: int, block: int | None) -> list[StreamEntry]:
        while True:
            reply = self._client.xreadgroup(
                self.group, self.consumer, {self.stream: start}, count=count, block=block
            )
            entries, gone = _entries(self.stream, _stream_reply(reply))
            if not gone:
                return entries
            # Nothing is left to process of a trimmed entry: ack it so it stops coming back.
            self.ack(*gone)
            if entries or start == ">":
                return entries
