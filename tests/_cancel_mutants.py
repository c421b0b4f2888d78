"""Mutation check of the cancellation sweeps with a contender (test_cancel_contender.py).

``python -m tests._cancel_mutants`` (from the repository root) copies the ``asynclock``
package to a temporary folder once per mutant, plants the mistake there (string
replacements, as tests/sim/mutants.py does), runs the contender sweeps against that copy
in a subprocess (stopping at the first failing test unless ``--all``), and reports per
mutant: caught or missed, the first finding (test, operation, point, property) and the
seconds the run took to it. Exit status 1 if a mutant is missed (or no longer applies).

The mutants, one per class of mistake the contender exists for:

- ``release-anyones``: the release script deletes the lock whoever holds it (the owner
  check reads "held by anyone");
- ``cancelled-grant-kept``: an acquire cancelled while its attempt was on its way does not
  give back what the server may have granted (other interruptions still do);
- ``fence-not-incremented``: the memory backend hands out the name's current fence again
  instead of the next one;
- ``redis-fence-not-incremented``: the Redis fence script neither adds one nor reads the
  clock: every grant of a name on one node gets the fence the counter already has.
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

import pytest

import asynclock

from .sim.mutants import Mutant, apply, run_planted

__all__ = ("MUTANTS", "Finding", "main", "run_mutant")

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = "tests/test_cancel_contender.py"
#: Set in the subprocess: the folder the mutated package must be imported from.
_EXPECT = "ASYNCLOCK_MUTANT_DIR"

MUTANTS = (
    Mutant(
        "release-anyones",
        "release without owner check: the release script deletes whoever holds the lock",
        (
            (
                "backends/redis/scripts.py",
                "local id = redis.sha1hex(ARGV[1])\n"
                "if redis.call('GET', KEYS[1]) == ARGV[1] then\n",
                "local id = redis.sha1hex(ARGV[1])\nif redis.call('GET', KEYS[1]) then\n",
            ),
        ),
    ),
    Mutant(
        "cancelled-grant-kept",
        "a late grant kept after a cancelled acquire: no give-back when the attempt is "
        "cancelled on its way",
        (
            (
                "_lock.py",
                "            engine.give_back_in_background(\n"
                "                claim, self.ttl, Interrupted.CANCELLED if cancelled else "
                "Interrupted.FAILED\n            )\n",
                "            if not isinstance(exc, asyncio.CancelledError):\n"
                "                engine.give_back_in_background(\n"
                "                    claim, self.ttl, Interrupted.CANCELLED if cancelled else "
                "Interrupted.FAILED\n                )\n",
            ),
        ),
    ),
    Mutant(
        "fence-not-incremented",
        "fence not incremented (memory): a grant gets the name's current fence again",
        (
            (
                "backends/memory.py",
                "fence = table.fences[name] = table.fences.get(name, 0) + 1\n",
                "fence = table.fences[name] = table.fences.get(name, 1)\n",
            ),
        ),
    ),
    Mutant(
        "redis-fence-not-incremented",
        "fence not incremented (Redis): the fence script neither adds one nor reads the clock",
        (
            (
                "backends/redis/scripts.py",
                "  local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])\n",
                "  local fence = 1\n",
            ),
            ("backends/redis/scripts.py", "    fence = last + 1\n", "    fence = last\n"),
        ),
    ),
)

# "<operation> k=<k> (<label>): [<property>] <detail>", as the sweeps report a finding.
_FINDING = re.compile(r"(?P<op>\S+) k=(?P<k>\d+) \((?P<label>[^)]*)\): \[(?P<property>[^\]]+)\]")
_FAILED = re.compile(r"^FAILED (?P<test>\S+)", re.MULTILINE)


@dataclass
class Finding:
    """The first finding of one failing test."""

    test: str
    op: str
    k: int
    label: str
    property: str


@dataclass
class Outcome:
    """What the sweeps did to one mutant."""

    mutant: str
    caught: bool
    seconds: float
    findings: list[Finding]
    error: str = ""


def _findings(output: str) -> list[Finding]:
    """The first finding of each failing test in a pytest run's output (-ra summary)."""
    found = []
    for failed in _FAILED.finditer(output):
        test = failed["test"]
        test = test[test.find("tests/") :] if "tests/" in test else test
        line = output[failed.end() : output.find("\n", failed.end())]
        match = _FINDING.search(line)
        if match is None:
            # The summary line is cut short; take the first report line naming it.
            section = output.find(test.split("::", 1)[-1])
            match = _FINDING.search(output, section if section >= 0 else 0)
        if match is not None:
            found.append(
                Finding(test, match["op"], int(match["k"]), match["label"], match["property"])
            )
    return found


def run_mutant(mutant: Mutant, tests: list[str], *, stop: bool, timeout: float) -> Outcome:
    """Run the contender sweeps ``tests`` against a copy of the package with ``mutant``."""
    with tempfile.TemporaryDirectory(prefix=f"asynclock-cancel-mutant-{mutant.name}-") as tmp:
        package = Path(tmp) / "asynclock"
        shutil.copytree(ROOT / "asynclock", package, ignore=shutil.ignore_patterns("__pycache__"))
        try:
            apply(mutant, package)
        except LookupError as exc:
            return Outcome(mutant.name, False, 0.0, [], str(exc))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, str(ROOT)]))
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env[_EXPECT] = str(package)
        command = [
            sys.executable,
            "-m",
            "pytest",
            *(test if os.path.isabs(test) else str(ROOT / test) for test in tests),
            "--rootdir",
            str(ROOT),
            "-c",
            str(ROOT / "pyproject.toml"),
            "-p",
            "tests._cancel_mutants",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rf",
            *(["-x"] if stop else []),
        ]
        # (the plugin below checks the mutated copy is the one imported)
        proc, seconds = run_planted(command, tmp, env, timeout)
        if proc is None:
            return Outcome(mutant.name, False, timeout, [], "timed out")
        if proc.returncode not in (0, 1):
            tail = (proc.stdout + proc.stderr)[-3000:]
            return Outcome(
                mutant.name, False, seconds, [], f"pytest exit {proc.returncode}: {tail}"
            )
        findings = _findings(proc.stdout)
        return Outcome(mutant.name, proc.returncode == 1, seconds, findings)


def pytest_configure(config: pytest.Config) -> None:
    """In the subprocess (loaded with ``-p``): refuse to run unless the mutated copy is
    the package imported."""
    expected = os.environ.get(_EXPECT)
    if expected is None:
        return
    where = Path(asynclock.__file__).resolve().parent
    if where != Path(expected).resolve():
        raise pytest.UsageError(f"the mutated copy is not the package imported ({where})")


def main(argv: list[str] | None = None) -> int:
    """Run every mutant (or those named); exit 1 if one is missed."""
    parser = argparse.ArgumentParser(prog="python -m tests._cancel_mutants", description=__doc__)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--tests", nargs="+", default=[SWEEPS], help="pytest node ids to run")
    parser.add_argument(
        "--all", action="store_true", help="run every test, not up to the first failure"
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    missed = False
    for mutant in chosen:
        outcome = run_mutant(mutant, args.tests, stop=not args.all, timeout=args.timeout)
        if outcome.caught:
            print(
                f"{mutant.name}: caught, the run ended after {outcome.seconds:.1f}s "
                f"[{mutant.description}]"
            )
            for f in outcome.findings:
                print(f"    {f.test}: {f.op} k={f.k} ({f.label}): [{f.property}]")
        else:
            missed = True
            why = f": {outcome.error}" if outcome.error else ""
            print(f"{mutant.name}: MISSED ({outcome.seconds:.1f}s){why}")
        sys.stdout.flush()
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
