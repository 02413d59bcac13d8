"""Configuration from the environment (``PAYORCH_*``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ProviderSettings", "Settings"]


class Settings(BaseSettings):
    """Values an operator sets per deployment; code passes its own values explicitly."""

    model_config = SettingsConfigDict(env_prefix="PAYORCH_", extra="ignore")

    database_url: str = "sqlite:///payorch.db"
    # Part of every downstream key and payorch_ref (payorch.core.namespace_ref): sets apart
    # installations that share one provider account with overlapping tenants and keys.
    # Set it once and never change it: keys already sent depend on it.
    key_scope: str = Field(default="", pattern=r"^([A-Za-z0-9][A-Za-z0-9_.:-]{0,63})?$")
    # PostgreSQL only: the schema payorch's tables (and its version table) live in.
    db_schema: str = Field(default="public", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    # PostgreSQL only, read by the engine itself (storage/_pooling.py): "transaction" when
    # database_url is a transaction-pooling PgBouncer; waiters then LISTEN on
    # listen_database_url (the server, not the pooler) or, without it, poll.
    database_pooler: Literal["none", "session", "transaction"] = "none"
    listen_database_url: str | None = None
    # The reconciler's lease must cover three provider calls (a lookup, a read and a
    # re-submission): 151 s with the Stripe adapter's default time-outs.
    lease_seconds: float = Field(default=180.0, gt=0)
    reconcile_interval_seconds: float = Field(default=5.0, gt=0)
    # Claims only while a synchronous standby streams (PostgreSQL): refused at start-up and
    # per claim otherwise. Stores read it from the environment themselves.
    require_sync_standby: bool = False
    reconcile_batch_size: int = Field(default=50, gt=0, le=1000)
    # Checks run at once per pass (unset: 8, or the pool size if smaller); 0 or more than
    # the database pool's size is refused at start-up by the reconciler.
    reconcile_concurrency: int | None = None
    # Where `payorch reconcile run` serves /metrics, /healthz and /readyz: host:port,
    # [v6]:port, or "off". Loopback by default: the numbers are not for the whole network.
    metrics_addr: str = "127.0.0.1:9464"
    not_found_grace_seconds: float = Field(default=60.0, ge=0)
    max_checks: int = Field(default=20, gt=0)
    max_unknown_age_seconds: float = Field(default=24 * 3600.0, gt=0)
    # A provider that cannot be asked (webhooks only): wait this long for its notification
    # before replaying the request inside its key window.
    webhook_grace_seconds: float = Field(default=120.0, ge=0, allow_inf_nan=False)
    # Opt-in (0: never): void an unknown authorisation (capture_method "manual") this many
    # seconds after its claim, where its provider can void, instead of leaving money held.
    void_after_seconds: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    # `payorch reconcile run` looks for provider effects no operation explains every this
    # many seconds (0: never), over the trailing window, at the providers named (comma
    # separated; empty: every configured one that can list), and adopts them when asked.
    unexplained_every_seconds: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    unexplained_window_seconds: float = Field(default=24 * 3600.0, gt=0, le=366 * 86400.0)
    unexplained_providers: str = ""
    unexplained_adopt: bool = False
    # Routing (payorch.routing): the routing table an app's integration loads (a TOML or
    # JSON file; unset: nothing routed), what the reconciler does about an effect found at
    # two providers for one namespace ("reverse": void, else refund, the later one;
    # "operator": flag only), and how often the daemon asks the providers routed
    # operations moved away from (0: never).
    routing: str | None = None
    route_duplicates: Literal["reverse", "operator"] = "reverse"
    fallback_watch_seconds: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    # The outbox (payorch.outbox): the hooks every process that settles operations loads,
    # and the sinks the daemon's relay delivers to, each a module:attribute import path.
    outbox_hooks: str | None = Field(default=None, pattern=r"^[\w.]+:[\w.]+$")
    outbox_sinks: str | None = Field(default=None, pattern=r"^[\w.]+:[\w.]+$")
    outbox_interval_seconds: float = Field(default=2.0, gt=0, allow_inf_nan=False)
    outbox_max_attempts: int = Field(default=12, gt=0, le=1000)
    outbox_batch_size: int = Field(default=50, gt=0, le=1000)
    # The sandbox's address and secret, also on ProviderSettings: services' snippets build
    # a SandboxProvider from these.
    sandbox_url: str = "http://127.0.0.1:8765"
    sandbox_webhook_secret: str | None = None

    @field_validator("database_url")
    @classmethod
    def _url_given(cls, value: str) -> str:
        # Set but empty (an unset variable in a template) is a mistake, not "the default".
        if not value.strip():
            raise ValueError(
                "PAYORCH_DATABASE_URL is set but empty: set a SQLAlchemy URL (e.g. "
                "sqlite:///payorch.db) or unset it"
            )
        return value


class ProviderSettings(BaseSettings):
    """Which provider adapters the tools beside the app (the CLI, the reconciler daemon) run.

    Read only by the commands that call a provider, so a provider setting that is wrong
    stops those commands alone, never ``ops list`` or ``stats``. ``PAYORCH_PROVIDERS``, when
    set, is the application's own adapters (``module:attribute``: a sequence of adapters,
    or a callable returning one), exactly as the app builds them; the settings below then
    are not read. Unset, the tools build the sandbox, and Stripe and Adyen from their keys.
    """

    model_config = SettingsConfigDict(env_prefix="PAYORCH_", extra="ignore")

    providers: str | None = Field(default=None, pattern=r"^[\w.]+:[\w.]+$")
    sandbox_url: str = "http://127.0.0.1:8765"
    sandbox_webhook_secret: str | None = None
    stripe_api_key: str | None = None
    stripe_webhook_secret: str | None = None
    # Any Stripe-compatible endpoint: its base URL, and how long it honours Idempotency-Key
    # (0: it ignores keys, so the reconciler never re-submits; Stripe keeps them 24 hours).
    stripe_base_url: str = "https://api.stripe.com"
    stripe_idempotency_window_seconds: float = Field(
        default=24 * 3600.0, ge=0, le=366 * 86400.0, allow_inf_nan=False
    )
    # Adyen (Checkout API and standard notifications): configured when an API key is set.
    adyen_api_key: str | None = None
    adyen_merchant_account: str | None = None
    # The notification HMAC key, hex as the Customer Area shows it. The tools never verify a
    # notification (the app's webhook route does): they do not need it, and ignore one that
    # is not hex with a warning.
    adyen_hmac_key: str | None = None
    # Your Checkout endpoint, version included (…/v71): required with an API key.
    adyen_base_url: str | None = None
