"""The WSGI application: ``gunicorn shop.wsgi --workers 4`` (``--preload`` or not)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
application = get_wsgi_application()
