"""``python manage.py nightly_report [--day YYYY-MM-DD]``: build a day's report, unless
another process is building it (cron on every machine is fine: one builds it)."""

import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from shop.locks import coordinator


@coordinator().singleton("report:{day}", ttl=60)
def build_report(day: str) -> int:
    """The long job; its lease is renewed while it runs (a killed run blocks the next for
    60 s at most). Returns the number of pages."""
    return 3


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type hints
    """The ``nightly_report`` command."""

    help = "Build a day's report, unless another process is building it."

    def add_arguments(self, parser: CommandParser) -> None:
        """``--day``: the day to report on (default: yesterday)."""
        parser.add_argument("--day", help="YYYY-MM-DD (default: yesterday)")

    def handle(self, *args: Any, **options: Any) -> None:
        """Build the report, or say that another process is building it."""
        day = options["day"] or str(datetime.date.today() - datetime.timedelta(days=1))
        pages = build_report(day)
        if pages is None:
            self.stdout.write(f"report {day}: skipped, another process is building it")
        else:
            self.stdout.write(f"report {day}: {pages} pages")
