"""What every command shares: settings, the store, provider adapters, durations, consoles."""

from __future__ import annotations

import getpass
import io
import logging
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TextIO, cast

import typer
from rich.console import Console

from ..errors import ConfigurationError, DatabaseUnavailable

if TYPE_CHECKING:
    from ..outbox import Relay
    from ..provider import Provider
    from ..reconciling._crossings import CrossCheck
    from ..reconciling._reconciler import Reconciler
    from ..settings import ProviderSettings, Settings
    from ..storage._store import Store

__all__ = [
    "DatabaseUrl",
    "JsonFlag",
    "Tenant",
    "build_providers",
    "database_url",
    "default_actor",
    "duration_option",
    "err",
    "given_url",
    "not_blank",
    "open_store",
    "out",
    "parse_duration",
    "provider_settings",
    "reconciler",
    "relay",
    "settings",
    "settings_error",
    "trimmed_stdout",
]

# Piped output (files, grep, tests) gets a wide console: ids must not be cut or wrapped.
_PIPE_WIDTH = 240


class _Trimmed(io.TextIOBase):
    """A pipe's lines without the spaces rich pads every table row and grid with to the
    console's width (hundreds of columns, for a wide timeline): files, grep and diff see
    the text only."""

    def __init__(self, target: TextIO) -> None:
        self._target = target

    @property
    def encoding(self) -> str:  # type: ignore[override]  # rich reads the file's encoding
        return getattr(self._target, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        # rich writes whole lines (a print ends with its newline); a line cut between two
        # writes keeps its padding, which is harmless.
        lines = text.split("\n")
        self._target.write("\n".join([line.rstrip(" ") for line in lines[:-1]] + lines[-1:]))
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def fileno(self) -> int:
        return self._target.fileno()


@contextmanager
def trimmed_stdout() -> Iterator[None]:
    """``sys.stdout`` without trailing padding while a command runs, when it is not a
    terminal: typer's help panels are padded too. A terminal is left as it is."""
    target = sys.stdout
    if target.isatty() or isinstance(target, _Trimmed):
        yield
        return
    # cast: a TextIOBase is a text file, though typeshed's TextIO names more methods
    sys.stdout = cast("TextIO", _Trimmed(target))
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = target


def out() -> Console:
    """Standard output, made per call so it follows ``sys.stdout`` (redirected in tests).
    Not a terminal: wide (ids are never cut or wrapped) and without trailing padding."""
    if sys.stdout.isatty():
        return Console(highlight=False)
    trimmed = sys.stdout if isinstance(sys.stdout, _Trimmed) else _Trimmed(sys.stdout)
    return Console(file=cast("TextIO", trimmed), width=_PIPE_WIDTH, highlight=False)


def err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def given_url(value: str | None) -> str | None:
    """An option's callback: ``--database-url ''`` is refused, never read as "not given" (a
    script whose variable came out empty must not fall back to another database)."""
    if value is not None and not value.strip():
        raise typer.BadParameter(
            "must not be empty: pass a SQLAlchemy URL (e.g. sqlite:///payorch.db), or leave "
            "the option out to use PAYORCH_DATABASE_URL"
        )
    return value


DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        help="SQLAlchemy URL; defaults to PAYORCH_DATABASE_URL, else sqlite:///payorch.db.",
        show_default=False,
        callback=given_url,
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


Tenant = Annotated[str | None, typer.Option("--tenant", help="Tenant id.")]


def not_blank(value: str | None) -> str | None:
    """An option's callback: a reason or an actor must say something."""
    if value is not None and not value.strip():
        raise typer.BadParameter("must not be empty")
    return value


def settings() -> Settings:
    import pydantic

    from ..settings import Settings

    try:
        return Settings()
    except pydantic.ValidationError as exc:
        raise ConfigurationError(settings_error(exc)) from None


def settings_error(exc: Any) -> str:
    """One line for a refused setting (a pydantic ``ValidationError``): the variable and
    why, without pydantic's own wording around it, and what to do. The value is not
    repeated: it may be a secret."""
    first = exc.errors()[0]
    name = "PAYORCH_" + "_".join(str(p) for p in first["loc"]).upper()
    cause = first.get("ctx", {}).get("error")
    # A validator's ValueError comes back as "Value error, <its text>": keep only the text.
    message = str(cause) if isinstance(cause, ValueError) else str(first["msg"])
    if not message.startswith(name):
        message = f"{name}: {message}"
    return f"{message} (fix the setting and run again)"


def database_url(value: str | None) -> str:
    """``--database-url`` if given (an empty one is refused, never a fall-back), else the
    settings' URL."""
    if value is None:
        return settings().database_url
    return given_url(value) or value


@contextmanager
def open_store(url: str | None, *, require_sync_standby: bool | None = None) -> Iterator[Store]:
    """A store on an existing database: a missing SQLite file is refused, not created.
    ``require_sync_standby`` defaults to ``PAYORCH_REQUIRE_SYNC_STANDBY``."""
    from ..storage._engine import create_engine
    from ..storage._pooling import normalise_url
    from ..storage._store import Store

    resolved = database_url(url)
    parsed = normalise_url(resolved)
    if parsed.get_backend_name() == "sqlite" and parsed.database is not None:
        path = Path(parsed.database)
        if not path.is_file():
            raise DatabaseUnavailable(
                f"no database at {path} (run `payorch db upgrade` or pass --database-url)"
            )
    hooks = None
    config = settings()
    if config.outbox_hooks:  # every process that may settle operations stages their messages
        from ..storage._outbox import load_hooks

        hooks = load_hooks(config.outbox_hooks)
    store = Store(
        create_engine(parsed), require_sync_standby=require_sync_standby, outbox_hooks=hooks
    )
    try:
        yield store
    finally:
        store.close()


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


_MAX_DURATION_SECONDS = 100 * 365 * 86400  # beyond this, datetime arithmetic overflows


def parse_duration(text: str) -> timedelta:
    """``30s``, ``15m``, ``2h``, ``1d``, ``1w`` or a sum such as ``1h30m``."""
    value = text.strip().lower()
    pos = 0
    total = 0.0
    for match in _DURATION.finditer(value):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if not value or pos != len(value):
        raise typer.BadParameter(
            f"{text!r} is not a duration; use a number and a unit, e.g. 30s, 15m, 2h, 1d"
        )
    if total > _MAX_DURATION_SECONDS:
        raise typer.BadParameter(f"{text!r} is longer than 100 years")
    return timedelta(seconds=total)


def duration_option(help_text: str, *, default: str | None = None) -> Any:
    """A ``--…`` option that takes a duration such as 30s, 15m, 2h or 1d; ``default`` is
    what a missing option means, for the help (the command applies it)."""
    if default is not None:
        # Escaped: typer reads help as rich markup, where a bare [default: 24h] is a tag.
        help_text = f"{help_text} \\[default: {default}]"
    return typer.Option(parser=parse_duration, metavar="DURATION", help=help_text)


def default_actor() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry / no login name in a container
        return "operator"


def provider_settings() -> ProviderSettings:
    """The provider settings, read only by the commands that call a provider."""
    import pydantic

    from ..settings import ProviderSettings

    try:
        return ProviderSettings()
    except pydantic.ValidationError as exc:
        raise ConfigurationError(settings_error(exc)) from None


def build_providers(config: ProviderSettings | None = None) -> list[Provider]:
    """The adapters the tools run: the application's own (``PAYORCH_PROVIDERS``), else the
    sandbox always, and Stripe and Adyen when their API keys are configured."""
    config = config or provider_settings()
    if config.providers:
        from ._adapters import load_providers

        return load_providers(config.providers, "PAYORCH_PROVIDERS")
    from ..providers.sandbox import SandboxProvider

    providers: list[Provider] = [
        SandboxProvider(base_url=config.sandbox_url, webhook_secret=config.sandbox_webhook_secret)
    ]
    if config.stripe_api_key:
        from ..providers.stripe import StripeProvider

        window = config.stripe_idempotency_window_seconds
        providers.append(
            StripeProvider(
                api_key=config.stripe_api_key,
                webhook_secret=config.stripe_webhook_secret,
                base_url=config.stripe_base_url,
                idempotency_window=timedelta(seconds=window) if window > 0 else None,
            )
        )
    if config.adyen_api_key:
        providers.append(_adyen(config))
    return providers


def close_adapters(adapters: Iterable[object]) -> None:
    """Close the adapters the tools built (their HTTP clients), those that can be."""
    for adapter in adapters:
        close = getattr(adapter, "close", None)
        if callable(close):
            close()


def _adyen(config: ProviderSettings) -> Provider:
    from ..providers.adyen import AdyenProvider
    from ..providers.adyen._notifications import decode_hmac_key

    needed = {
        "PAYORCH_ADYEN_MERCHANT_ACCOUNT": config.adyen_merchant_account,
        "PAYORCH_ADYEN_BASE_URL": config.adyen_base_url,
    }
    missing = [name for name, value in needed.items() if not value]
    if missing:
        raise ConfigurationError(f"Adyen needs {' and '.join(missing)} too")
    hmac_key = config.adyen_hmac_key
    if hmac_key is not None:
        try:
            decode_hmac_key(hmac_key)
        except ConfigurationError:
            # The tools never verify a notification (the app's webhook route does), so a
            # key they cannot use is no reason to stop them; said once, where it is read.
            logging.getLogger("payorch.cli").warning(
                "PAYORCH_ADYEN_HMAC_KEY is not the hex HMAC key (e.g. 44782D…): ignored here, "
                "where no notification is verified; the webhook route needs the right one"
            )
            hmac_key = None
    return AdyenProvider(
        api_key=config.adyen_api_key or "",
        merchant_account=str(config.adyen_merchant_account),
        hmac_key=hmac_key,
        base_url=str(config.adyen_base_url),
    )


@contextmanager
def reconciler(
    store: Store,
    config: Settings,
    *,
    owner: str | None = None,
    batch: int | None = None,
    concurrency: int | None = None,
) -> Iterator[Reconciler]:
    """A reconciler configured from ``config``; its adapters' HTTP clients close on exit."""
    from ..reconciling._reconciler import Reconciler, ReconcilerPolicy

    policy = ReconcilerPolicy(
        lease=timedelta(seconds=config.lease_seconds),
        batch_size=batch or config.reconcile_batch_size,
        not_found_grace=timedelta(seconds=config.not_found_grace_seconds),
        max_checks=config.max_checks,
        max_unknown_age=timedelta(seconds=config.max_unknown_age_seconds),
        concurrency=concurrency if concurrency is not None else config.reconcile_concurrency,
        webhook_grace=timedelta(seconds=config.webhook_grace_seconds),
        void_after=(
            timedelta(seconds=config.void_after_seconds) if config.void_after_seconds else None
        ),
    )
    providers = build_providers()
    try:
        rec = Reconciler(store=store, providers=providers, policy=policy, owner=owner)
        rec.crossings = crossings(store, providers, rec.owner, config)
        yield rec
    finally:
        for provider in providers:
            close = getattr(provider, "close", None)
            if callable(close):
                close()


def crossings(store: Store, providers: list[Provider], owner: str, config: Settings) -> CrossCheck:
    """The check of routed operations' earlier providers, with the policy the settings name
    (PAYORCH_ROUTE_DUPLICATES) and an executor for the refunds that policy may run."""
    from ..execution._executor import Executor
    from ..reconciling._crossings import CrossCheck, DuplicatePolicy

    refunds = Executor(store=store, providers=providers, owner=owner) if providers else None
    return CrossCheck(
        store=store,
        providers={p.name: p for p in providers},
        owner=owner,
        policy=DuplicatePolicy(config.route_duplicates),
        refunds=refunds,
    )


@contextmanager
def relay(store: Store, config: Settings, *, required: bool) -> Iterator[Relay | None]:
    """The outbox relay over ``PAYORCH_OUTBOX_SINKS`` (None when unset and not ``required``);
    its sinks close on exit."""
    if not config.outbox_sinks:
        if required:
            raise ConfigurationError(
                "no sinks: set PAYORCH_OUTBOX_SINKS to module:attribute (a mapping of "
                "destination names to sinks)"
            )
        yield None
        return
    from ..outbox import Relay, RelayPolicy, load_sinks

    policy = RelayPolicy(
        batch_size=config.outbox_batch_size, max_attempts=config.outbox_max_attempts
    )
    with Relay(store, load_sinks(config.outbox_sinks), policy=policy) as made:
        yield made
