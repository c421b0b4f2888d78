"""Exploring the blocking API's interrupts: a ``KeyboardInterrupt`` sent to the waiting
thread at a random moment of ``with coord.lock(...)`` (while it waits, just after the
grant, in the body, during the release) must never leave a lock held, never leave
``coord.held`` disagreeing with the server, never drop a held lease to the garbage
collector, and always surface as itself. A deliberately broken interrupt path (the
waiting thread walks away from its acquire) must be caught by the same sweep.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

import asynclock
import asynclock.sync
from asynclock.sync import _portal

pytestmark = [pytest.mark.explore, pytest.mark.timeout(300)]

ROUNDS = 60


class _KernelTimer:
    """A SIGPROF after ``delay`` seconds of the process's CPU time: delivered by the
    kernel at any moment, with no thread that needs the GIL first, so the handler runs
    on whatever line the main thread is at (as a Ctrl-C from a terminal does)."""

    def __init__(self, delay: float) -> None:
        signal.setitimer(signal.ITIMER_PROF, max(delay, 1e-6))

    def cancel(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0)

    def join(self) -> None:
        pass


@pytest.fixture
def interrupts() -> Iterator[Callable[[float], threading.Timer]]:
    """``arm(delay)``: a KeyboardInterrupt in the main thread about ``delay`` seconds from
    now, only while ``armed[0]`` is true. Every other one is sent to the process by a
    timer thread (SIGUSR1: pytest-timeout owns SIGALRM), as ``kill -INT`` is: another
    thread may take it, and the main thread runs the handler at its next chance (after a
    lock it waited for was already taken, say); the others come from a kernel timer
    (SIGPROF, on CPU time), which lands on any line, waiting or not."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    armed = [False]
    count = [0]

    def handler(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, handler)
    previous_prof = signal.signal(signal.SIGPROF, handler)

    def arm(delay: float) -> threading.Timer:
        armed[0] = True
        count[0] += 1
        if count[0] % 2:
            return _KernelTimer(delay)  # type: ignore[return-value]
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        return timer

    arm.armed = armed  # type: ignore[attr-defined]
    yield arm
    armed[0] = False
    signal.setitimer(signal.ITIMER_PROF, 0)
    signal.signal(signal.SIGUSR1, previous)
    signal.signal(signal.SIGPROF, previous_prof)


def _sweep(
    url: str, options: dict[str, Any], arm: Callable[[float], threading.Timer], seed: int
) -> tuple[list[str], int]:
    """Interrupt ``ROUNDS`` lock cycles at random moments: what went wrong, and how many
    interrupts reached the caller."""
    rng = random.Random(seed)
    armed: list[bool] = arm.armed  # type: ignore[attr-defined]
    problems: list[str] = []
    dropped_logs: list[str] = []

    class Dropped(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "dropped without release" in record.getMessage():
                dropped_logs.append(record.getMessage())

    handler = Dropped()
    logging.getLogger("asynclock").addHandler(handler)
    with (
        asynclock.sync.connect(url, **options) as coord,
        asynclock.sync.connect(url, **options) as other,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always", ResourceWarning)
        interrupted = 0
        for round_ in range(ROUNDS):
            name = f"sweep{round_ % 3}"
            holder = None
            if rng.random() < 0.5:  # sometimes the acquire has to wait
                holder = other.lock(name, ttl=10).acquire()
                release = threading.Timer(rng.uniform(0, 0.01), holder.release)
                release.start()
            delay = rng.uniform(0, 0.012)
            outcome: BaseException | None = None
            timer: threading.Timer | None = None
            try:
                try:
                    timer = arm(delay)  # inside: an interrupt may come at once
                    with coord.lock(name, ttl=10, timeout=10):
                        time.sleep(rng.choice((0, 0, 0.001, 0.004)))
                finally:
                    armed[0] = False
            except KeyboardInterrupt:
                interrupted += 1
            except BaseException as exc:  # any other outcome is a finding
                outcome = exc
            if timer is not None:
                timer.cancel()
                timer.join()
            if holder is not None:
                release.join()
            if outcome is not None:
                problems.append(f"round {round_}: {outcome!r} instead of KeyboardInterrupt")
            settle = time.monotonic() + 5
            while time.monotonic() < settle and (coord.held or other.is_locked(name)):
                time.sleep(0.005)
            if coord.held:
                problems.append(f"round {round_}: coord.held = {coord.held}")
            if other.is_locked(name):
                problems.append(f"round {round_}: {name} still locked on the server")
        gc.collect()
        dropped = [w for w in caught if "dropped while held" in str(w.message)]
        problems.extend(f"a held lease was dropped: {w.message}" for w in dropped)
    gc.collect()
    logging.getLogger("asynclock").removeHandler(handler)
    problems.extend(f"logged: {message}" for message in dropped_logs)
    return problems, interrupted


@pytest.mark.parametrize("kind", ["memory", "redis", "postgres"])
def test_interrupts_at_random_moments_leave_nothing_held(
    kind: str,
    request: pytest.FixtureRequest,
    namespace: str,
    interrupts: Callable[[float], threading.Timer],
) -> None:
    """However an interrupt lands in a lock cycle, nothing stays held and the interrupt
    is what the caller sees."""
    if kind == "memory":
        url, options = f"memory://{namespace}", {}
    elif kind == "redis":
        url, options = request.getfixturevalue("asynclock_redis_url"), {"prefix": namespace}
    else:
        url = request.getfixturevalue("asynclock_postgres_dsn")
        options = {"namespace": namespace}
    problems, interrupted = _sweep(url, options, interrupts, seed=hash(kind) & 0xFFFF)
    assert problems == []
    # (Kernel timers count CPU time: on memory:// many fire after their sub-millisecond
    # round, and are not counted; the timer thread's interrupts land.)
    assert interrupted >= ROUNDS // 20, "the sweep hardly interrupted anything"


def test_the_sweep_catches_a_waiter_that_walks_away(
    asynclock_redis_url: str,
    namespace: str,
    interrupts: Callable[[float], threading.Timer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mutant: an interrupted acquire is left running instead of cancelled and undone;
    its grant reaches nobody. The sweep must report it."""

    def walk_away(self: Any, loop: Any, call: Any, interrupt: Any, undo: Any) -> None:
        return None

    monkeypatch.setattr(_portal.LoopThread, "_interrupted", walk_away)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        problems, _ = _sweep(asynclock_redis_url, {"prefix": namespace}, interrupts, seed=7)
        gc.collect()
    assert problems


def test_an_interrupted_close_still_closes(
    asynclock_redis_url: str, namespace: str, interrupts: Callable[[float], threading.Timer]
) -> None:
    """An interrupt at a random moment around close(), called from inside the caller's
    own block: a close() after it returns (never hangs), and the coordinator ends closed,
    its loop thread gone, nothing held."""
    armed: list[bool] = interrupts.armed  # type: ignore[attr-defined]
    rng = random.Random(11)
    watcher = asynclock.sync.connect(asynclock_redis_url, prefix=namespace)
    try:
        for round_ in range(30):
            coord = asynclock.sync.connect(asynclock_redis_url, prefix=namespace)
            timer: threading.Timer | None = None
            try:
                try:
                    with coord.lock("own", ttl=10):
                        timer = interrupts(rng.uniform(0, 0.004))
                        coord.close()
                finally:
                    armed[0] = False
            except KeyboardInterrupt:
                pass
            if timer is not None:
                timer.cancel()
                timer.join()
            # The interrupt may have come before close() began (then it closes now), in
            # it (then this waits for the first one's end), or after: either way this
            # returns, and everything is closed.
            coord.close()
            assert coord.closed, round_
            assert wait_until_quiet(), round_
            assert not watcher.is_locked("own"), round_
    finally:
        watcher.close()


def wait_until_quiet(within: float = 10.0) -> bool:
    """True once no loop thread but the watcher's is alive."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        loops = [t for t in threading.enumerate() if t.name.startswith("asynclock-loop")]
        if len(loops) <= 1:
            return True
        time.sleep(0.01)
    return False
