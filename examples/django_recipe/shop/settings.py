"""The recipe's settings: the least Django needs, and ``ASYNCLOCK_URL``."""

import os

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "the-recipe-has-no-secrets")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = ["shop"]  # for its management command
ROOT_URLCONF = "shop.urls"
MIDDLEWARE: list[str] = []
DATABASES: dict[str, dict[str, str]] = {}
USE_TZ = True

#: The lock server: a Redis/Valkey URL, a list of them (Redlock), or a PostgreSQL DSN.
ASYNCLOCK_URL = os.environ.get("ASYNCLOCK_URL", "redis://127.0.0.1:6379/0")
