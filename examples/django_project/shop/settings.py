"""Settings of the example shop. payorch reads its own block, ``PAYORCH``."""

import os

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
# No models: payorch keeps its own tables (`payorch db upgrade`); the app adds a check that
# `manage.py check --database default` runs before a deploy.
INSTALLED_APPS = ["payorch.integrations.django.PayorchAppConfig"]
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
ROOT_URLCONF = "shop.urls"
WSGI_APPLICATION = "shop.wsgi.application"
ASGI_APPLICATION = "shop.asgi.application"
DATABASES: dict[str, dict[str, str]] = {}
USE_TZ = True
APPEND_SLASH = False

PAYORCH = {
    # SQLite by default; e.g. postgresql+psycopg://user@host/db in production.
    "DATABASE_URL": os.environ.get("PAYORCH_DATABASE_URL", "sqlite:///payorch-example.db"),
    # A dotted path to a factory: adapters are built on first use, not at import.
    "PROVIDERS": "shop.payments.providers",
    # Who the tenant is: here a header a trusted gateway sets; or "user", or "kwarg:tenant".
    "TENANT": "header:X-Tenant-Id",
}
