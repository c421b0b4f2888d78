"""What every benchmark script shares: per-operation timing, summaries, the table."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

Op = Callable[[], Awaitable[object]]


@dataclass
class Summary:
    case: str
    ops: int
    median_us: float
    p99_us: float
    mean_us: float
    ops_per_s: float


def summarize(case: str, samples_ns: list[int]) -> Summary:
    ordered = sorted(samples_ns)
    n = len(ordered)
    median = statistics.median(ordered) / 1000
    p99 = ordered[min(n - 1, round(0.99 * (n - 1)))] / 1000
    mean = statistics.fmean(ordered) / 1000
    return Summary(case, n, round(median, 1), round(p99, 1), round(mean, 1), round(1e6 / mean))


async def timed(op: Op, n: int, into: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        started = clock()
        await op()
        into.append(clock() - started)


async def run_cases(
    cases: dict[str, Op], *, rounds: int, per_round: int, warmup: int
) -> dict[str, Summary]:
    """Warm every case up, then run them in alternating rounds; summaries by case."""
    samples: dict[str, list[int]] = {case: [] for case in cases}
    for op in cases.values():  # connections open, scripts loaded, caches warm
        await timed(op, warmup, [])
    for i in range(rounds):
        order = list(cases.items())
        if i % 2:
            order.reverse()
        for case, op in order:
            await timed(op, per_round, samples[case])
        print(f"\r  round {i + 1}/{rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {case: summarize(case, s) for case, s in samples.items()}


def report(summaries: dict[str, Summary], floor: str, **context: object) -> dict[str, object]:
    """The JSON-able report: context, results, and ratios to the ``floor`` case."""
    base = summaries[floor]
    ratios = {
        case: {
            "median_ratio": round(s.median_us / base.median_us, 3),
            "p99_ratio": round(s.p99_us / base.p99_us, 3),
        }
        for case, s in summaries.items()
    }
    return {
        **context,
        "floor": floor,
        "results": [asdict(s) for s in summaries.values()],
        "ratios_to_floor": ratios,
    }


def print_table(result: dict[str, object]) -> None:
    results = result["results"]
    ratios = result["ratios_to_floor"]
    assert isinstance(results, list)
    assert isinstance(ratios, dict)
    header = (
        f"{'case':34} {'ops':>7} {'median us':>10} {'p99 us':>9} {'ops/s':>8} "
        f"{'x floor':>7} {'p99 x':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in results:
        r = ratios[row["case"]]
        print(
            f"{row['case']:34} {row['ops']:>7} {row['median_us']:>10.1f} {row['p99_us']:>9.1f} "
            f"{row['ops_per_s']:>8} {r['median_ratio']:>7.3f} {r['p99_ratio']:>6.3f}"
        )
