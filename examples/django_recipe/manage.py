#!/usr/bin/env python
"""Django's command line for the recipe (``python manage.py nightly_report``)."""

import os
import sys


def main() -> None:
    """Run a Django command with the recipe's settings."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.management import execute_from_command_line  # noqa: PLC0415

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
