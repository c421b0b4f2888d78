"""Run seeds: one to replay it, or many (in parallel processes) to explore.

``python -m tests.sim.runner --seed 123 --trace`` replays seed 123 and prints its whole
trace; ``python -m tests.sim.runner --seeds 0:2000 --jobs 2`` explores a range and stops
at the first failure (``--all`` goes on), printing seeds per second. ``--kind redis`` or
``--kind redlock`` runs the real Redis backends over simulated nodes instead of the
simulated memory table (``--kind memory``, the default).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence

from .invariants import KNOWN_BUGS
from .redis_world import KINDS
from .workload import Result, run_seed

__all__ = ("Summary", "explore", "main", "parse_range")

# Seeds per task sent to a worker process.
_CHUNK = 25


class Summary:
    """What an exploration found."""

    def __init__(self) -> None:
        self.seeds = 0
        self.failures: list[Result] = []
        self.seconds = 0.0
        self.first_failure_after: float | None = None

    @property
    def rate(self) -> float:
        """Seeds per second of wall time."""
        return self.seeds / self.seconds if self.seconds else 0.0


def _run_chunk(
    seeds: Sequence[int],
    stop_at_first: bool,
    kind: str = "memory",
    ignore: frozenset[str] = frozenset(),
) -> list[Result]:
    out = []
    for seed in seeds:
        result = run_seed(seed, kind=kind, ignore=ignore)
        out.append(result)
        if not result.ok and stop_at_first:
            break
    return out


def _chunks(seeds: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for i in range(0, len(seeds), size):
        yield seeds[i : i + size]


def explore(
    seeds: Sequence[int],
    *,
    jobs: int = 2,
    stop_at_first: bool = True,
    kind: str = "memory",
    ignore: frozenset[str] = frozenset(),
) -> Summary:
    """Run ``seeds`` of backend ``kind`` on ``jobs`` processes (1: in this process);
    failures in seed order. ``ignore``: invariants not checked."""
    summary = Summary()
    began = time.perf_counter()
    if jobs <= 1:
        for seed in seeds:
            result = run_seed(seed, kind=kind, ignore=ignore)
            summary.seeds += 1
            if not result.ok:
                summary.failures.append(result)
                summary.first_failure_after = summary.first_failure_after or (
                    time.perf_counter() - began
                )
                if stop_at_first:
                    break
        summary.seconds = time.perf_counter() - began
        return summary
    context = multiprocessing.get_context("spawn")
    # Smaller chunks for the slower kinds: both processes stay busy to the end.
    size = _CHUNK if kind == "memory" else 5
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [
            pool.submit(_run_chunk, chunk, stop_at_first, kind, ignore)
            for chunk in _chunks(seeds, size)
        ]
        try:
            for future in futures:
                results = future.result()
                summary.seeds += len(results)
                bad = [r for r in results if not r.ok]
                if bad:
                    summary.failures.extend(bad)
                    if summary.first_failure_after is None:
                        summary.first_failure_after = time.perf_counter() - began
                    if stop_at_first:
                        break
        finally:
            for future in futures:
                future.cancel()
    summary.seconds = time.perf_counter() - began
    summary.failures.sort(key=lambda r: r.seed)
    return summary


def parse_range(text: str) -> list[int]:
    """``"A:B"`` (B excluded), ``"N"`` (0..N-1) or ``"a,b,c"``."""
    if ":" in text:
        lo, hi = text.split(":", 1)
        return list(range(int(lo), int(hi)))
    if "," in text:
        return [int(part) for part in text.split(",") if part]
    return list(range(int(text)))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: replay one seed or explore a range; exit 1 on a failure."""
    parser = argparse.ArgumentParser(prog="python -m tests.sim.runner", description=__doc__)
    parser.add_argument("--seed", type=int, help="replay this seed")
    parser.add_argument("--trace", action="store_true", help="print the whole trace")
    parser.add_argument("--seeds", default="2000", help="range to explore: A:B, N or a,b,c")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--all", action="store_true", help="go on after the first failure")
    parser.add_argument(
        "--kind", default="memory", choices=("memory", *KINDS), help="the simulated backend"
    )
    parser.add_argument(
        "--strict", action="store_true", help="report known engine bugs too (see KNOWN_BUGS)"
    )
    args = parser.parse_args(argv)
    if args.seed is not None:
        tolerate = frozenset() if args.strict else KNOWN_BUGS
        result = run_seed(args.seed, full_trace=args.trace, tolerate=tolerate, kind=args.kind)
        if args.trace:
            print("\n".join(result.trace))
        print(result.report() if not result.ok else f"seed {args.seed}: ok")
        print(
            f"digest {result.digest} virtual {result.virtual:.3f}s steps {result.steps} "
            f"requests {result.requests} ops {result.ops}"
        )
        return 0 if result.ok else 1
    seeds = parse_range(args.seeds)
    summary = explore(seeds, jobs=args.jobs, stop_at_first=not args.all, kind=args.kind)
    for failure in summary.failures:
        print(failure.report())
    print(
        f"{summary.seeds} seeds in {summary.seconds:.1f}s ({summary.rate:.1f} seeds/s), "
        f"{len(summary.failures)} failing"
        + (
            f", first after {summary.first_failure_after:.1f}s"
            if summary.first_failure_after is not None
            else ""
        )
    )
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
