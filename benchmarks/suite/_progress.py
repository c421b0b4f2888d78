"""Progress while the suite runs: a rich bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any, Protocol, TextIO

__all__ = ("PlainProgress", "Progress", "RichProgress", "make_progress")


class Progress(Protocol):
    """What the suite reports while it runs."""

    def begin(self, total: int) -> None:
        """The run has ``total`` units of work."""

    def phase(self, text: str) -> None:
        """What runs now."""

    def advance(self, units: int = 1) -> None:
        """``units`` more are done."""

    def note(self, text: str) -> None:
        """A line worth keeping above the progress display."""

    def end(self) -> None:
        """The run is over (also after an error or Ctrl-C)."""


class PlainProgress:
    """One line per phase on ``stream`` (stderr), with the share done and the time spent."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._total = 1
        self._done = 0
        self._started = time.monotonic()

    def begin(self, total: int) -> None:
        self._total = max(total, 1)
        self._done = 0
        self._started = time.monotonic()

    def phase(self, text: str) -> None:
        share = 100 * self._done / self._total
        elapsed = time.monotonic() - self._started
        print(f"[{share:3.0f}% {elapsed:6.1f}s] {text}", file=self._stream, flush=True)

    def advance(self, units: int = 1) -> None:
        self._done += units

    def note(self, text: str) -> None:
        print(f"  {text}", file=self._stream, flush=True)

    def end(self) -> None:
        pass


class RichProgress:
    """A rich progress bar on stderr: spinner, phase, bar, done/total, elapsed."""

    def __init__(self, rich_progress: Any, rich_console: Any) -> None:
        console = rich_console.Console(stderr=True)
        self._bar = rich_progress.Progress(
            rich_progress.SpinnerColumn(),
            rich_progress.TextColumn("{task.description}"),
            rich_progress.BarColumn(),
            rich_progress.TaskProgressColumn(),
            rich_progress.TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task: Any = None

    def begin(self, total: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task("starting", total=max(total, 1))

    def phase(self, text: str) -> None:
        self._bar.update(self._task, description=text)

    def advance(self, units: int = 1) -> None:
        self._bar.advance(self._task, units)

    def note(self, text: str) -> None:
        self._bar.console.print(f"  {text}", markup=False, highlight=False)

    def end(self) -> None:
        finished = self._bar.tasks[0].finished if self._bar.tasks else False
        self._bar.update(self._task, description="done" if finished else "stopped")
        self._bar.stop()


def make_progress(*, plain: bool = False) -> Progress:
    """A rich bar when rich is installed and stderr is a terminal, plain lines otherwise."""
    if not plain and sys.stderr.isatty():
        try:
            rich_progress = importlib.import_module("rich.progress")
            rich_console = importlib.import_module("rich.console")
        except ImportError:
            pass
        else:
            return RichProgress(rich_progress, rich_console)
    return PlainProgress()
