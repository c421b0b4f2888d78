"""``python manage.py nightly_report``."""
