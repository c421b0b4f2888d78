"""asynclock in a Django project: a recipe to copy.

- ``shop/settings.py``: ``ASYNCLOCK_URL``, where the locks live;
- ``shop/locks.py``: one coordinator per process, made on first use;
- ``shop/views.py``: ``POST /invoices/<pk>/pay`` pays an invoice under its lock
  (``423 Locked`` when another request holds it for more than 5 s);
- ``shop/management/commands/nightly_report.py``: ``python manage.py nightly_report``
  builds a day's report once at a time, whichever machine runs it;
- ``shop/wsgi.py``: for ``gunicorn shop.wsgi``.

Try it (``pip install django 'asynclock[redis]'``, a Redis or Valkey on 6379)::

    cd examples/django_recipe
    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 python manage.py runserver
    curl -X POST http://127.0.0.1:8000/invoices/42/pay
    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 python manage.py nightly_report --day 2026-12-04

``tests/test_django_recipe.py`` runs it against a real Valkey.
"""
