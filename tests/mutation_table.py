"""The mutant x checker table: which exploring checker catches which class of mistake.

``python -m tests.mutation_table`` (from the repository root) takes one planted mistake
per class (a minimal edit of asynclock/, :class:`tests.sim.mutants.Mutant`), and for each
exploring checker copies the repository's ``asynclock/`` and ``tests/`` to a temporary
folder, plants the mistake there, and runs that checker's ``-m explore`` tests against
the copy (stopping at the first failure). It prints, per mutant and checker: caught
(the property the first failure names, and the seconds the run took to it) or missed.
Exit status 1 when a mutant is caught by no checker, or no longer applies.

``--only NAME`` runs one mutant; ``--checkers sim,chaos`` some checkers; ``--markdown``
prints the table as Markdown.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ._cancel_mutants import MUTANTS as CANCEL_MUTANTS
from .chaos_mutants import PLANTED
from .sim.mutants import ALL_MUTANTS as SIM_MUTANTS
from .sim.mutants import Mutant, apply, run_planted

__all__ = ("CHECKERS", "ROWS", "Cell", "main", "run_cell")

ROOT = Path(__file__).resolve().parents[1]

#: Each exploring checker: its ``-m explore`` test files.
CHECKERS: dict[str, tuple[str, ...]] = {
    "simulator": ("tests/test_sim.py",),
    "chaos": ("tests/test_chaos.py",),
    # (The contender's sweeps first: they name the property a mistake breaks.)
    "cancel points": ("tests/test_cancel_contender.py", "tests/test_cancel_points.py"),
}


def _find(name: str, source: str) -> Mutant:
    lists = {
        "sim": SIM_MUTANTS,
        "chaos": tuple(planted.mutant for planted in PLANTED),
        "cancel": CANCEL_MUTANTS,
    }
    (mutant,) = [m for m in lists[source] if m.name == name]
    return mutant


#: One planted mistake per class of the issue's table: (class, mutant).
ROWS: tuple[tuple[str, Mutant], ...] = (
    ("renewal scheduled too late (0.9 x TTL)", _find("late-renewal", "chaos")),
    ("validity counted from the reply, not the request", _find("validity-from-reply", "chaos")),
    ("drift allowance dropped", _find("drift-dropped", "chaos")),
    ("lease marked lost, body not cancelled", _find("lost-body-runs", "sim")),
    ("a late grant kept after a cancelled acquire", _find("cancelled-grant-kept", "cancel")),
    ("release without owner check", _find("release-anyones", "cancel")),
    ("Redlock majority miscounted", _find("redlock-majority", "sim")),
    ("fence not incremented", _find("redis-fence-not-incremented", "cancel")),
    ("extend() succeeding after the server refused it", _find("extend-refused-believed", "chaos")),
    # (The memory backend's: the Redis one, the release script without its PUBLISH, is
    # caught only by a quiet chaos run, whose hand-off bound a loaded machine loosens.)
    ("release wakes nobody", _find("wake-nobody", "sim")),
)


@dataclass(frozen=True)
class Cell:
    """One checker's run on one mutant."""

    caught: bool
    what: str  # the property (or the first failure line) that caught it, or why not
    seconds: float

    def __str__(self) -> str:
        if self.caught:
            return f"caught: {self.what} ({self.seconds:.0f} s)"
        return f"missed ({self.seconds:.0f} s{'; ' + self.what if self.what else ''})"


_PROPERTY = re.compile(r"\[([a-z0-9][a-z0-9 \-]*[a-z0-9])\]")
# A chaos problem names its property before a colon (the report's summary row also
# shows ``handoff-p99=...`` on every run: not a finding).
_CHAOS = re.compile(r"\b(belief-vs-server|handoff-p99|renewal-headroom|loss-ceiling)\s*:")


def _property(output: str) -> str:
    """The property a failed run names: a ``[property]`` tag of its first error lines, a
    chaos finding's name, or else its first error line."""
    errors = [line[1:].strip() for line in output.splitlines() if line.startswith("E ")]
    for line in errors:  # a chaos run's history checks: its summary row's counters
        counts = dict(
            re.findall(r"\b(violations|after-loss|lost|late-entries|stranded)=(\d+)", line)
        )
        named = [f"{key}={value}" for key, value in counts.items() if value != "0"]
        if named:
            return "history: " + ", ".join(named)
    for line in errors:
        for pattern in (_PROPERTY, _CHAOS):
            found = pattern.search(line)
            if found:
                return found.group(1)
    for line in output.splitlines():
        found = _CHAOS.search(line)
        if found and "problem" in line:
            return found.group(1)
    # A report given to pytest.fail without a traceback (the simulator's): its lines,
    # not the test ids in the headers and the summary.
    found = re.search(r"invariant (\S+) violated", output)
    if found:
        return found.group(1)
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR", "_")) or "::" in line:
            continue
        found = _PROPERTY.search(line)
        if found:
            return found.group(1)
    return (errors[0][:100] if errors else "") or "a failing test"


def run_cell(
    mutant: Mutant, files: tuple[str, ...], timeout: float, log: Path | None = None
) -> Cell:
    """Run ``files``' exploring tests against a copy of the repository with ``mutant``;
    the run's output is written to ``log`` when given."""
    with tempfile.TemporaryDirectory(prefix=f"asynclock-table-{mutant.name}-") as tmp:
        copy = Path(tmp)
        ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache")
        shutil.copytree(ROOT / "asynclock", copy / "asynclock", ignore=ignore)
        shutil.copytree(ROOT / "tests", copy / "tests", ignore=ignore)
        shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
        try:
            apply(mutant, copy / "asynclock")
        except LookupError as exc:
            return Cell(False, f"does not apply: {exc}", 0.0)
        env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        command = [sys.executable, "-m", "pytest", "-m", "explore", "-x", "-q", "-p"]
        command += ["no:cacheprovider", *files]
        proc, seconds = run_planted(command, copy, env, timeout)
        if proc is None:
            return Cell(False, f"no verdict within {timeout:.0f} s", timeout)
        if log is not None:
            log.write_text(proc.stdout + proc.stderr)
        if proc.returncode == 0:
            return Cell(False, "", seconds)
        if proc.returncode == 5:
            return Cell(False, "no exploring test selected", seconds)
        return Cell(True, _property(proc.stdout), seconds)


def main(argv: list[str] | None = None) -> int:
    """Run the table; exit status 1 if a mutant is caught by no checker."""
    parser = argparse.ArgumentParser(prog="python -m tests.mutation_table", description=__doc__)
    parser.add_argument("--only", action="append", help="a mutant's name (repeatable)")
    parser.add_argument("--checkers", help="comma-separated: " + ", ".join(CHECKERS))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--logs", type=Path, help="a folder for each run's output")
    args = parser.parse_args(argv)
    checkers = args.checkers.split(",") if args.checkers else list(CHECKERS)
    rows = [(label, m) for label, m in ROWS if not args.only or m.name in args.only]
    uncaught = 0
    table: list[list[str]] = []
    for label, mutant in rows:
        cells: list[str] = []
        any_caught = False
        for checker in checkers:
            log = None
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                log = args.logs / f"{mutant.name}.{checker.replace(' ', '-')}.log"
            cell = run_cell(mutant, CHECKERS[checker], args.timeout, log)
            any_caught |= cell.caught
            cells.append(str(cell))
            print(f"{mutant.name:30} {checker:14} {cell}", flush=True)
        uncaught += not any_caught
        table.append([f"{label} (`{mutant.name}`)", *cells])
    if args.markdown:
        print("\n| mutant | " + " | ".join(checkers) + " |")
        print("|---" * (len(checkers) + 1) + "|")
        for row in table:
            print("| " + " | ".join(row) + " |")
    return 1 if uncaught else 0


if __name__ == "__main__":
    sys.exit(main())
