"""Mutation check: re-introduce fixed engine bugs and plant new ones; the default seeds
must catch each (a planted one by the invariant meant to catch it: ``CAUGHT_BY``).

``python -m tests.sim.mutants`` (from the repository root) copies the ``asynclock``
package to a temporary folder once per mutant, puts the fixed code back to its buggy
form there (string replacements of the fix), runs the default seeds against that copy in
a subprocess (stopping at the first failure), and reports per mutant: killed or
survived, the first failing seed and its invariant, and the seconds to that failure.
Exit status 1 if any mutant survives (or a replacement no longer applies: the engine
changed under it, and the mutant must be brought up to date).

The mutants (see ``git log`` for the fixes):

- ``extend-race`` (4d9b495, 4eb4cc5): the watchdog's renewal reply sets validity from
  the lease's current ``ttl`` instead of the ttl that request asked, and ``extend()``
  does not wait for a renewal in flight (extends of one lease not ordered);
- ``election-cancel`` (8eba980): a campaign cancelled during its "elected" or
  "resigned" announcement leaves the lock without releasing it, a lease renewed forever;
- ``grant-cancel`` (a2b8688): a grant that races a cancel while the wait is being left
  (the waiter's exit suspends) is not given back;
- ``giveup-exit`` (issue 14, item 8): a waiter whose exit from the wait is interrupted (a
  second cancel as the first one's clean-up starts) does not leave the waiter queue in
  the background; its place stays until it lapses.

Mutants of the Redis protocol code, caught by the Redis kinds' seeds (the real backends
over simulated nodes, :mod:`tests.sim.redis_world`; ``Mutant.kind`` says which):

- ``redlock-majority``: Redlock's majority is miscounted (``n // 2``, one short);
- ``fence-not-incremented``: the acquire scripts' fence does not move past a counter
  that is ahead of the server's clock (it repeats the last fence);
- ``release-no-owner``: the release script deletes the lock whoever holds it;
- ``validity-from-reply``: a lease's validity is counted from the grant's reply instead
  of from before its request was sent.

Planted, not re-introduced (classes of mistake that only the liveness properties of
invariant 8 see, and one the safety invariants should):

- ``late-renewal``: the watchdog renews at 0.9 x TTL instead of every TTL/3 (safe, but a
  renewal slower than a tenth of the TTL loses the lease): ``8-no-loss``;
- ``wake-nobody``: a release frees the lock but wakes no waiter (they fall back on their
  backoff timers): ``8-hand-off``;
- ``lost-body-runs``: a lease marked lost does not cancel its body: ``8-body-stopped``;
- ``no-drift``: the drift allowance is dropped (a lease believes it lasts as long as the
  server keeps it, on a server whose clock may run fast): ``1-validity``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asynclock

from .runner import explore, parse_range

__all__ = (
    "ALL_MUTANTS",
    "CAUGHT_BY",
    "LIVENESS_MUTANTS",
    "MUTANTS",
    "Mutant",
    "Outcome",
    "main",
    "run_mutant",
)

ROOT = Path(__file__).resolve().parents[2]
#: The default run's seeds (tests/test_sim.py explores the same range).
DEFAULT_SEEDS = "0:5000"
#: The default run's seeds of the Redis kinds, slower per seed (tests/test_sim.py).
KIND_SEEDS = {"memory": DEFAULT_SEEDS, "redis": "0:300", "redlock": "0:120"}


@dataclass(frozen=True)
class Mutant:
    """A re-introduced bug: in ``path`` (under asynclock/), ``old`` becomes ``new``."""

    name: str
    description: str
    edits: tuple[tuple[str, str, str], ...]  # (path, fixed code, buggy code)
    kind: str = "memory"  # the simulated backend whose seeds must catch it


MUTANTS = (
    Mutant(
        "extend-race",
        "defect 1: renewal validity from the current lease.ttl; extends not ordered",
        (
            (
                "_watchdog.py",
                "                lease.confirmed(start, ttl)\n",
                "                lease.confirmed(start, lease.ttl)\n",
            ),
            (
                "_lease.py",
                "            if not self._renewing:\n                break\n",
                "            break\n",
            ),
        ),
    ),
    Mutant(
        "election-cancel",
        "defect 2: a cancel during an election announcement leaks the lease",
        (
            (
                "_election.py",
                """        try:
            await self._announce("elected", term)
        except BaseException as exc:
            # Cancelled (from outside, or by our own loss) while announcing: the caller
            # never gets the term, so give the lease back here, and let the lock turn
            # its own loss cancel into LeadershipLost.
            self._terms.pop(task, None)
            await self._lock.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return term
""",
                """        await self._announce("elected", term)
        return term
""",
            ),
            (
                "_election.py",
                """        try:
            if term is not None and term.lease.held:
                await self._announce("resigned", term)
        except BaseException as interrupted:
            await self._lock.__aexit__(type(interrupted), interrupted, interrupted.__traceback__)
            raise
        await self._lock.__aexit__(exc_type, exc, tb)
""",
                """        if term is not None and term.lease.held:
            await self._announce("resigned", term)
        await self._lock.__aexit__(exc_type, exc, tb)
""",
            ),
        ),
    ),
    Mutant(
        "grant-cancel",
        "defect 3: a grant racing a cancel while leaving the wait is not given back",
        (
            (
                "_lock.py",
                "        with undo_on_interrupt(engine.release_in_background, claim, self.ttl):\n"
                "            await waiter.__aexit__(None, None, None)\n",
                "        await waiter.__aexit__(None, None, None)  # the grant is dropped\n",
            ),
        ),
    ),
    Mutant(
        "giveup-exit",
        "defect 4: a waiter cancelled again while leaving its wait keeps its place in line",
        (
            (
                "_lock.py",
                "            with undo_on_interrupt(*give_up):\n"
                "                await waiter.__aexit__(type(exc), exc, exc.__traceback__)\n",
                "            await waiter.__aexit__(type(exc), exc, exc.__traceback__)\n",
            ),
        ),
    ),
    Mutant(
        "redlock-majority",
        "Redlock majority miscounted: n // 2 nodes are taken for a majority",
        (
            (
                "backends/redlock.py",
                "        self.quorum = len(self._nodes) // 2 + 1\n",
                "        self.quorum = len(self._nodes) // 2\n",
            ),
        ),
        kind="redlock",
    ),
    Mutant(
        "fence-not-incremented",
        "the acquire scripts repeat a fence counter that is ahead of the server's clock",
        (("backends/redis/scripts.py", "    fence = last + 1\n", "    fence = last\n"),),
        kind="redlock",
    ),
    Mutant(
        "release-no-owner",
        "the release script deletes the lock without checking who holds it",
        (
            (
                "backends/redis/scripts.py",
                "if redis.call('GET', KEYS[1]) == ARGV[1] then\n  redis.call('DEL', KEYS[1])\n",
                "if redis.call('GET', KEYS[1]) then\n  redis.call('DEL', KEYS[1])\n",
            ),
        ),
        kind="redis",
    ),
    Mutant(
        "validity-from-reply",
        "a lease's validity counted from the grant's reply, not from before the request",
        (
            (
                "_lock.py",
                "            attempt, start = await self._grant(claim, deadline)\n"
                "            if attempt.start is not None:\n",
                "            attempt, start = await self._grant(claim, deadline)\n"
                "            start = clock.now()\n"
                "            if attempt.start is not None:\n",
            ),
        ),
        kind="redis",
    ),
)


LIVENESS_MUTANTS = (
    Mutant(
        "late-renewal",
        "renewal scheduled at 0.9 x TTL instead of TTL/3",
        (
            (
                "_lease.py",
                "        self._interval = ttl / 3\n",
                "        self._interval = ttl * 0.9\n",
            ),
            (
                "_lease.py",
                "        self._interval = effective / 3\n",
                "        self._interval = effective * 0.9\n",
            ),
        ),
    ),
    Mutant(
        "wake-nobody",
        "a release frees the lock and wakes no waiter",
        (
            (
                "backends/memory.py",
                """            if claim.kind is PERMIT:
                table.hub.notify_one(claim.name)  # one permit came free
            elif not holders:
                del table.holders[claim.name]
                del table.exclusive[claim.name]
                fair = claim.kind is FAIR
                first = next(iter(table.queue(claim.name, now)), None) if fair else None
                if first is not None:
                    table.hub.notify_tag(claim.name, first)  # the first in line, and only it
                elif claim.kind is SHARED or claim.name in table.writer_waiting:
                    table.hub.notify_all(claim.name)  # the writer, or every reader
                else:
                    table.hub.notify_one(claim.name)
            return True
""",
                """            if claim.kind is not PERMIT and not holders:
                del table.holders[claim.name]
                del table.exclusive[claim.name]
            return True
""",
            ),
        ),
    ),
    Mutant(
        "lost-body-runs",
        "a lease marked lost does not cancel its body",
        (
            (
                "_lease.py",
                "            self._cancel_body(task, loop.time() + _REDELIVER_EAGER,"
                " _REDELIVER_FIRST)\n",
                "",
            ),
        ),
    ),
    Mutant(
        "no-drift",
        "the drift allowance dropped: local validity is the full TTL",
        (
            (
                "backends/base.py",
                "        return ttl * self.drift_factor + self.drift_base\n",
                "        return 0.0\n",
            ),
        ),
    ),
)
ALL_MUTANTS = MUTANTS + LIVENESS_MUTANTS
#: The invariant that must be the first to catch each planted mutant (the others, left
#: on, must not catch it first; ``--ignore`` that one to see it survive without it).
CAUGHT_BY = {
    "late-renewal": "8-no-loss",
    "wake-nobody": "8-hand-off",
    "lost-body-runs": "8-body-stopped",
    "no-drift": "1-validity",
}


@dataclass
class Outcome:
    """What the seeds did to one mutant."""

    mutant: str
    killed: bool
    seed: int | None
    invariant: str
    seconds: float
    error: str = ""
    report: str = ""


def apply(mutant: Mutant, package: Path) -> None:
    """Turn the fixed code in ``package`` (a copy of asynclock/) into the buggy code."""
    for path, fixed, buggy in mutant.edits:
        file = package / path
        text = file.read_text()
        if text.count(fixed) != 1:
            raise LookupError(f"{mutant.name}: the fixed code is not (once) in {path}")
        file.write_text(text.replace(fixed, buggy))


def run_planted(
    command: list[str], cwd: str | Path, env: dict[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess[str] | None, float]:
    """Run ``command`` from a planted copy's folder (``cwd``): the working directory comes
    first on ``sys.path``, so the mutated asynclock is the one imported. Its completed
    process (None if it ran past ``timeout``) and the seconds it took."""
    began = time.perf_counter()
    try:
        proc = subprocess.run(  # noqa: S603 - our own interpreter and module
            command,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, timeout
    return proc, time.perf_counter() - began


def run_mutant(
    mutant: Mutant, seeds: str | None, jobs: int, timeout: float, ignore: Sequence[str] = ()
) -> Outcome:
    """Run ``seeds`` (None: the default seeds of the mutant's kind) against a copy of the
    package with ``mutant`` applied, the invariants named in ``ignore`` unchecked."""
    with tempfile.TemporaryDirectory(prefix=f"asynclock-mutant-{mutant.name}-") as tmp:
        package = Path(tmp) / "asynclock"
        shutil.copytree(ROOT / "asynclock", package, ignore=shutil.ignore_patterns("__pycache__"))
        try:
            apply(mutant, package)
        except LookupError as exc:
            return Outcome(mutant.name, False, None, "", 0.0, str(exc))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, str(ROOT)]))
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        command = [
            sys.executable,
            "-m",
            "tests.sim.mutants",
            "--child",
            "--seeds",
            seeds or KIND_SEEDS[mutant.kind],
            "--jobs",
            str(jobs),
            "--kind",
            mutant.kind,
            *(f"--ignore={name}" for name in ignore),
        ]
        # (tests.sim from the repository, the mutated asynclock from the copy)
        proc, seconds = run_planted(command, tmp, env, timeout)
        if proc is None:
            return Outcome(mutant.name, False, None, "", timeout, "timed out")
        lines = proc.stdout.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("FIRST "):
                _, seed, invariant, after = line.split(" ", 3)
                report = "\n".join(lines[i + 1 :])
                return Outcome(mutant.name, True, int(seed), invariant, float(after), "", report)
            if line.startswith("NONE"):
                return Outcome(mutant.name, False, None, "", seconds)
        return Outcome(mutant.name, False, None, "", seconds, proc.stderr[-2000:])


def _child(seeds: str, jobs: int, kind: str, ignore: frozenset[str]) -> int:
    """In the subprocess: check the copy is the one imported, explore, say what failed."""
    where = Path(asynclock.__file__).resolve().parent
    if where == ROOT / "asynclock":
        print("the mutated copy is not the package imported", file=sys.stderr)
        return 2
    summary = explore(parse_range(seeds), jobs=jobs, stop_at_first=True, kind=kind, ignore=ignore)
    if summary.failures:
        first = summary.failures[0]
        print(f"FIRST {first.seed} {first.invariant} {summary.first_failure_after or 0.0:.2f}")
        print(first.report())
    else:
        print(f"NONE {summary.seeds}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run every mutant (or those named); exit 1 if one survives, or a planted one is
    caught first by another invariant than the one meant to catch it."""
    parser = argparse.ArgumentParser(prog="python -m tests.sim.mutants", description=__doc__)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--seeds", help="seeds to run (default: the mutant kind's defaults)")
    parser.add_argument("--kind", default="memory", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--verbose", action="store_true", help="print each failure's report")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="INVARIANT",
        help="leave this invariant unchecked (e.g. 8-hand-off: is the mutant caught without it?)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(
            args.seeds or KIND_SEEDS[args.kind], args.jobs, args.kind, frozenset(args.ignore)
        )
    chosen = [m for m in ALL_MUTANTS if not args.names or m.name in args.names]
    survived = False
    for mutant in chosen:
        outcome = run_mutant(mutant, args.seeds, args.jobs, args.timeout, args.ignore)
        expected = CAUGHT_BY.get(mutant.name) if not args.ignore else None
        if outcome.killed and expected is not None and outcome.invariant != expected:
            survived = True
            print(
                f"{mutant.name}: killed by seed {outcome.seed} ({outcome.invariant}), "
                f"not by {expected} ({outcome.seconds:.1f}s)  [{mutant.description}]"
            )
            if args.verbose:
                print(outcome.report)
        elif outcome.killed:
            print(
                f"{mutant.name}: killed by {mutant.kind} seed {outcome.seed} "
                f"({outcome.invariant}) after {outcome.seconds:.1f}s  [{mutant.description}]"
            )
            if args.verbose:
                print(outcome.report)
        else:
            survived = True
            why = f": {outcome.error}" if outcome.error else ""
            print(f"{mutant.name}: SURVIVED ({outcome.seconds:.1f}s){why}")
        sys.stdout.flush()
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
