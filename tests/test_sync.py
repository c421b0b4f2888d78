"""asynclock.sync, the blocking API: the lock contract from threads and processes on
every backend (exclusion, fences, timeouts, bad input, loss), what replaces cancellation
(``lease.lost``, ``check()``, ``on_lost``, ``LockLost`` at the block's end), interrupts,
closing, fork, and that every call keeps its async twin's arguments, defaults and errors.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import asynclock
import asynclock.sync
from asynclock.backends import MemoryBackend

pytestmark = pytest.mark.timeout(120)

BACKENDS = ("memory", "redis", "postgres", "redlock")
SERVERS = ("redis", "postgres", "redlock")
REDLOCK_NODE_TIMEOUT = 0.25


@pytest.fixture
def target(request: pytest.FixtureRequest, namespace: str) -> tuple[Any, dict[str, Any]]:
    """What asynclock.sync.connect() takes for the backend under test."""
    kind = getattr(request, "param", "memory")
    if kind == "memory":
        return f"memory://{namespace}", {}
    if kind == "redis":
        return request.getfixturevalue("asynclock_redis_url"), {"prefix": namespace}
    if kind == "postgres":
        return request.getfixturevalue("asynclock_postgres_dsn"), {"namespace": namespace}
    urls = request.getfixturevalue("asynclock_redlock_urls")
    return urls, {"prefix": namespace, "node_timeout": REDLOCK_NODE_TIMEOUT}


@pytest.fixture
def make_sync(target: tuple[Any, dict[str, Any]]) -> Iterator[Callable[..., Any]]:
    """A factory of blocking coordinators on the backend under test, closed at the end."""
    made: list[asynclock.sync.Coordinator] = []

    def make(**options: Any) -> asynclock.sync.Coordinator:
        url, defaults = target
        coord = asynclock.sync.connect(url, **{**defaults, **options})
        made.append(coord)
        return coord

    yield make
    for coord in made:
        coord.close()


def wait_until(predicate: Callable[[], bool], within: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``within`` seconds pass; its last value."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def overlaps(history: list[tuple[int, float, float]]) -> list[str]:
    """What is wrong with a history of (fence, entered, left) holds of one lock: two
    holds that overlap in time, or fences that do not increase in the order of the
    holds."""
    problems = []
    ordered = sorted(history, key=lambda hold: hold[1])
    for earlier, later in itertools.pairwise(ordered):
        if later[1] < earlier[2]:
            problems.append(f"holds overlap: {earlier} and {later}")
        if later[0] <= earlier[0]:
            problems.append(f"fence did not increase: {earlier} then {later}")
    return problems


def test_the_history_check_catches_overlaps_and_fences_going_back() -> None:
    """The checker the exclusion tests rely on fails on what it must catch."""
    assert overlaps([(1, 0.0, 1.0), (2, 1.0, 2.0)]) == []
    assert overlaps([(1, 0.0, 1.0), (2, 0.5, 2.0)])
    assert overlaps([(2, 0.0, 1.0), (1, 1.0, 2.0)])


# -- the contract from threads -----------------------------------------------------------


@pytest.mark.parametrize("target", BACKENDS, indirect=True)
def test_threads_exclude_each_other_and_fences_increase(make_sync: Callable[..., Any]) -> None:
    """Six threads, on two coordinators, take one lock in turn: never two holders, and
    each holder's fence is greater than the one before."""
    coords = [make_sync(), make_sync()]
    history: list[tuple[int, float, float]] = []
    errors: list[BaseException] = []

    def worker(coord: asynclock.sync.Coordinator) -> None:
        try:
            for _ in range(4):
                with coord.lock("shared", ttl=10, timeout=30) as lease:
                    entered = time.monotonic()
                    time.sleep(0.005)
                    history.append((lease.fence, entered, time.monotonic()))
        except BaseException as exc:  # reported below, with the thread's failure
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(coords[i % 2],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert len(history) == 24
    assert overlaps(history) == []
    assert all(coord.held == [] for coord in coords)


@pytest.mark.parametrize("target", BACKENDS, indirect=True)
def test_timeouts_bad_input_and_a_wake_up(make_sync: Callable[..., Any]) -> None:
    """timeout=0 tries once, timeout>0 waits that long, a release wakes a waiter, and
    bad arguments raise at once, as in async code."""
    coord = make_sync()
    other = make_sync()
    with coord.lock("t", ttl=10) as lease:
        assert lease.held
        assert not lease.lost
        lease.check()
        info = other.inspect("t")
        assert info is not None
        assert info.fence == lease.fence
        assert other.is_locked("t")
        with pytest.raises(asynclock.LockTimeout):
            other.lock("t", timeout=0).acquire()
        began = time.monotonic()
        with pytest.raises(asynclock.LockTimeout):
            other.lock("t", timeout=0.3).acquire()
        assert time.monotonic() - began >= 0.25
    assert not other.is_locked("t")
    # A waiter gets the lock when it is released (not at its timeout).
    holder = coord.lock("w", ttl=10).acquire()
    got: list[asynclock.sync.Lease] = []
    waiter = threading.Thread(target=lambda: got.append(other.lock("w", timeout=30).acquire()))
    waiter.start()
    time.sleep(0.2)
    assert not got
    holder.release()
    waiter.join(30)
    assert got
    assert got[0].fence > holder.fence
    got[0].release()
    with pytest.raises(ValueError, match="ttl"):
        coord.lock("x", ttl=0)
    with pytest.raises(TypeError):
        coord.lock(42)
    with pytest.raises(ValueError, match="timeout"):
        coord.lock("x", timeout=-1)


@pytest.mark.parametrize("target", ["memory", "redis", "postgres"], indirect=True)
def test_semaphores_and_read_write_locks_from_threads(make_sync: Callable[..., Any]) -> None:
    """A semaphore admits at most ``limit`` threads; readers share, a writer excludes.
    (Redlock has neither: its refusal is the async twin's, see the bad-input tests.)"""
    coord = make_sync()
    inside = 0
    most = 0
    mutex = threading.Lock()

    def permit() -> None:
        nonlocal inside, most
        with coord.semaphore("pool", 2, ttl=10, timeout=30):
            with mutex:
                inside += 1
                most = max(most, inside)
            time.sleep(0.05)
            with mutex:
                inside -= 1

    threads = [threading.Thread(target=permit) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert most == 2
    rw = coord.rwlock("doc", ttl=10)
    with rw.read() as first:
        readers: list[asynclock.sync.Lease] = []
        reader = threading.Thread(target=lambda: readers.append(rw.read().acquire()))
        reader.start()  # another reader gets in
        reader.join(30)
        second = readers[0]
        assert second.held
        with pytest.raises(asynclock.LockTimeout):
            make_sync().rwlock("doc", timeout=0.2).write().acquire()
        second.release()
    with rw.write(), pytest.raises(asynclock.LockTimeout):
        make_sync().rwlock("doc", timeout=0.2).read().acquire()
    assert not first.held


# -- the contract across processes --------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import json, sys, time
    import asynclock.sync

    target, options, rounds, locked, start_at = json.loads(sys.argv[1])
    history = []
    with asynclock.sync.connect(target, **options) as coord:
        coord.is_locked("across")  # connected, before the common start
        time.sleep(max(0.0, start_at - time.time()))
        for _ in range(rounds):
            if locked:
                with coord.lock("across", ttl=10, timeout=60) as lease:
                    entered = time.time()
                    time.sleep(0.01)
                    history.append((lease.fence, entered, time.time()))
            else:  # the deliberately broken lock: the check below must catch it
                entered = time.time()
                time.sleep(0.01)
                history.append((len(history), entered, time.time()))
    print(json.dumps(history))
    """
)


def _run_processes(target: tuple[Any, dict[str, Any]], *, locked: bool) -> list[Any]:
    url, options = target
    # All three start together (after their imports and connections), so that the
    # unlocked run overlaps for sure and the locked one contends.
    argument = json.dumps([url, options, 8, locked, time.time() + 5.0])
    processes = [
        subprocess.Popen(  # noqa: S603 - this interpreter, the test's own script
            [sys.executable, "-c", _WORKER, argument], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    history: list[Any] = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=90)
            assert process.returncode == 0
            history.extend(tuple(hold) for hold in json.loads(out))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return history


@pytest.mark.parametrize("target", SERVERS, indirect=True)
def test_processes_exclude_each_other(target: tuple[Any, dict[str, Any]]) -> None:
    """Three processes take one lock in turn through the blocking API: the holds never
    overlap (wall clock of one machine) and fences increase; without the lock, the same
    check sees the overlaps."""
    history = _run_processes(target, locked=True)
    assert len(history) == 24
    assert overlaps(history) == []
    broken = _run_processes(target, locked=False)
    assert any("overlap" in problem for problem in overlaps(broken))


# -- loss without cancellation --------------------------------------------------------------


def test_a_lease_kept_by_renewals_while_the_thread_works(make_sync: Callable[..., Any]) -> None:
    """The loop thread renews while the calling thread sleeps past the TTL."""
    coord = make_sync()
    with coord.lock("long", ttl=1.2) as lease:
        fence = lease.fence
        time.sleep(3.0)  # two and a half TTLs: only renewals keep it
        lease.check()
        assert lease.held
        assert lease.fence == fence
    assert not coord.is_locked("long")


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_lost_lease_is_told_to_the_thread(
    make_sync: Callable[..., Any], target: tuple[Any, dict[str, Any]]
) -> None:
    """When a renewal is refused (the key was deleted behind the holder's back), the body
    runs on, but ``lost`` turns true, ``check()`` raises, ``on_lost`` is called in a
    worker thread, and leaving the block raises LockLost."""
    url, options = target
    coord = make_sync()
    calls: list[tuple[asynclock.sync.Lease, str]] = []
    called = threading.Event()

    def on_lost(lease: asynclock.sync.Lease) -> None:
        calls.append((lease, threading.current_thread().name))
        called.set()

    raw = redis.Redis.from_url(url)
    with (
        pytest.raises(asynclock.LockLost) as caught,
        coord.lock("victim", ttl=0.6, on_lost=on_lost) as lease,
    ):
        for key in raw.scan_iter(f"{options['prefix']}*"):
            raw.delete(key)
        assert wait_until(lambda: lease.lost)
        assert not lease.held
        with pytest.raises(asynclock.LockLost, match="victim"):
            lease.check()
        assert called.wait(10)
        assert calls[0][0] is lease
        assert calls[0][1] != threading.current_thread().name
    assert caught.value.name == "victim"
    raw.close()


def test_a_lease_whose_validity_ran_out_reads_lost(make_sync: Callable[..., Any]) -> None:
    """Without renewal, a lease past its TTL is lost for the thread at once (it need not
    wait for the watchdog), and its block raises LockLost."""
    coord = make_sync()
    with pytest.raises(asynclock.LockLost), coord.lock("short", ttl=0.2, renew=False) as lease:
        time.sleep(0.4)
        assert lease.lost
        with pytest.raises(asynclock.LockLost):
            lease.check()


def test_check_after_release_and_repr(make_sync: Callable[..., Any]) -> None:
    """A released lease's check() says released, not lost."""
    coord = make_sync()
    lease = coord.lock("r", ttl=5).acquire()
    assert "expires_in" in repr(lease)
    lease.release()
    assert "released" in repr(lease)
    assert not lease.lost
    with pytest.raises(asynclock.LockNotOwned, match="released"):
        lease.check()


def test_a_body_error_wins_and_the_lock_is_released(make_sync: Callable[..., Any]) -> None:
    """An exception from the block propagates and the lock is given back; a
    KeyboardInterrupt from the block propagates as itself."""
    coord = make_sync()
    with pytest.raises(ZeroDivisionError), coord.lock("e", ttl=5):
        1 / 0  # noqa: B018
    assert not coord.is_locked("e")
    with pytest.raises(KeyboardInterrupt), coord.lock("e", ttl=5):
        raise KeyboardInterrupt
    assert not coord.is_locked("e")


def test_reentry_by_the_same_thread_is_refused(make_sync: Callable[..., Any]) -> None:
    """A thread that would wait for its own lease is told so at once."""
    coord = make_sync()
    lock = coord.lock("re", ttl=5)
    with lock:
        with pytest.raises(RuntimeError, match="not reentrant"):
            lock.__enter__()
        with pytest.raises(RuntimeError, match="not reentrant"), coord.lock("re", ttl=5):
            pass
    with lock:  # usable again once left
        pass


def test_an_interrupted_wait_gives_the_lock_back(make_sync: Callable[..., Any]) -> None:
    """Ctrl-C (SIGINT) while waiting for a lock raises KeyboardInterrupt in the waiting
    thread, and whatever was granted is given back: the lock is free after its holder
    leaves, and the waiter holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    coord = make_sync()
    other = make_sync()
    holder = other.lock("int", ttl=10).acquire()
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        coord.lock("int", timeout=30).acquire()
    timer.join()
    holder.release()
    assert wait_until(lambda: not coord.held)
    after = coord.lock("int", timeout=5).acquire()
    assert after.fence > holder.fence
    after.release()


# -- closing ------------------------------------------------------------------------------


def test_close_from_inside_a_block_and_from_another_thread(
    make_sync: Callable[..., Any],
) -> None:
    """A close from a block's own thread releases its lease and the block ends without
    error; another thread's block then raises LockLost; calls after the close raise
    CoordinatorClosed."""
    coord = make_sync()
    entered = threading.Event()
    leave = threading.Event()
    outcome: list[BaseException | None] = []

    def other_thread() -> None:
        try:
            with coord.lock("b", ttl=10):
                entered.set()
                leave.wait(10)
        except BaseException as exc:  # recorded for the assertion below
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=other_thread)
    thread.start()
    assert entered.wait(10)
    with coord.lock("a", ttl=10) as own:
        coord.close()
        assert not own.held
    leave.set()
    thread.join(10)
    assert isinstance(outcome[0], asynclock.LockLost)
    assert coord.closed
    with pytest.raises(asynclock.CoordinatorClosed):
        coord.lock("a").acquire()
    with pytest.raises(asynclock.CoordinatorClosed), coord:
        pass
    coord.close()  # idempotent
    watcher = make_sync()
    assert not watcher.is_locked("a")
    assert not watcher.is_locked("b")


# -- decorators and elections --------------------------------------------------------------


@pytest.mark.parametrize("target", ["memory", "redis"], indirect=True)
def test_singleton_and_locked_for_plain_functions(make_sync: Callable[..., Any]) -> None:
    """Of calls with one name at once, one runs and the others return None; another name
    runs apart; @locked waits its turn; an async def is refused."""
    coord: asynclock.sync.Coordinator = make_sync()
    runs: list[int] = []
    started = threading.Event()

    @coord.singleton("job:{n}", ttl=10)
    def job(n: int) -> int:
        runs.append(n)
        started.set()
        time.sleep(0.3)
        return n * 2

    results: list[int | None] = []
    threads = [threading.Thread(target=lambda: results.append(job(1))) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert runs == [1]
    assert sorted(results, key=lambda r: r is None) == [2, None, None, None, None]
    assert job(2) == 4

    order: list[int] = []

    @coord.locked("serial", ttl=10, timeout=30)
    def serial(n: int) -> None:
        order.append(n)
        time.sleep(0.05)
        order.append(n)

    threads = [threading.Thread(target=serial, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [order[i] == order[i + 1] for i in range(0, 6, 2)] == [True] * 3

    async def coroutine_job() -> None:
        pass

    with pytest.raises(TypeError, match="async def"):
        coord.singleton("x")(coroutine_job)
    with pytest.raises(ValueError, match="nope"):
        coord.singleton("x:{nope}")(lambda n: n)


@pytest.mark.parametrize("target", ["memory", "redis", "postgres"], indirect=True)
def test_elections_from_threads(make_sync: Callable[..., Any]) -> None:
    """One leader at a time; terms increase; observe() follows the changes; a resigned
    leader's successor takes over."""
    first = make_sync(identity="first")
    second = make_sync(identity="second")
    seen: list[str | None] = []
    watching = threading.Event()

    def observe() -> None:
        for leader in second.election("e", ttl=5).observe():
            seen.append(leader)
            watching.set()
            if len(seen) == 3:
                return

    observer = threading.Thread(target=observe)
    observer.start()
    assert watching.wait(10)
    with first.election("e", ttl=5).leadership() as term:
        assert term.fence > 0
        term.check()
        assert second.election("e").leader() == "first"
        taken: list[asynclock.sync.Term] = []

        def campaign() -> None:
            with second.election("e", ttl=5).leadership() as later:
                taken.append(later)

        candidate = threading.Thread(target=campaign)
        candidate.start()
        time.sleep(0.2)
        assert not taken
    candidate.join(20)
    assert taken
    assert taken[0].fence > term.fence
    observer.join(20)
    assert seen[0] is None
    assert "first" in seen


def test_run_refuses_an_async_callback(make_sync: Callable[..., Any]) -> None:
    """Election.run() of the blocking API takes plain functions."""

    async def lead(term: Any) -> None:
        pass

    with pytest.raises(TypeError, match="async def"):
        make_sync().election("e").run(lead)


# -- fork ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:This process .* fork:DeprecationWarning")
@pytest.mark.parametrize("target", ["memory", "redis", "postgres"], indirect=True)
def test_a_coordinator_used_after_fork(
    make_sync: Callable[..., Any], target: tuple[Any, dict[str, Any]]
) -> None:
    """After a real fork(), a coordinator the parent was using (loop thread running,
    connections open) works in the child on a fresh loop and fresh connections, refuses
    the parent's lease, and leaves the parent's connections alone."""
    coord = make_sync()
    parent_lease = coord.lock("parent", ttl=10).acquire()
    pid = os.fork()
    if pid == 0:  # the child: report by exit status, never return into pytest
        status = 1
        try:
            signal.alarm(60)  # never a hang
            assert parent_lease.lost
            with pytest.raises(asynclock.LockLost):
                parent_lease.release()
            with coord.lock("child", ttl=5, timeout=5) as lease:
                assert lease.fence > 0
            if target[0].startswith("memory"):
                # In-process tables: the child's start empty (the parent's holder is not
                # the child's), fences go on.
                assert not coord.is_locked("parent")
            else:
                assert coord.is_locked("parent")
            assert not coord.is_locked("child")
            coord.close()
            status = 0
        except BaseException:  # the status tells the parent
            import traceback  # noqa: PLC0415 - the child's report

            traceback.print_exc()
        finally:
            os._exit(status)
    deadline = time.monotonic() + 90
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's coordinator and lease were not disturbed by the child.
    assert parent_lease.held
    parent_lease.check()
    with coord.lock("after", ttl=5, timeout=5):
        pass
    parent_lease.release()


@pytest.mark.filterwarnings("ignore:This process .* fork:DeprecationWarning")
def test_a_coordinator_of_a_backend_object_fails_clearly_after_fork() -> None:
    """A coordinator made from a backend object cannot reconnect in a child: it says so
    (never a hang, never the parent's connections)."""
    coord = asynclock.sync.Coordinator(MemoryBackend())
    with coord.lock("x", ttl=5):
        pass
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            signal.alarm(30)
            try:
                coord.lock("x")
            except RuntimeError as exc:
                status = 0 if "fork()" in str(exc) else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    coord.close()


# -- the twin API ----------------------------------------------------------------------------

# Where the blocking API differs from the async one on purpose, and why.
_ADDED = {
    ("Coordinator", "lock"): {"on_lost"},  # a thread is not cancelled: a callback instead
    ("Coordinator", "semaphore"): {"on_lost"},
    ("Coordinator", "rwlock"): {"on_lost"},
}
_RENAMED = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
_ONLY_SYNC = {
    "Coordinator": {"aio", "call"},  # the async coordinator, and a hop into its loop
    "Lease": {"check"},
    "Term": {"check", "lost"},
}
# Engine-internal members of the async classes (the watchdog's and the lock's protocol).
_INTERNAL = {
    "Lease": {
        "begin_request",
        "confirmed",
        "end_after_background_release",
        "end_block",
        "end_released",
        "enter_body",
        "in_body_of",
        "leave_body",
        "mark_lost",
        "releasing",
        "renew_interval",
        "renewing",
        "renews",
        "retry_delay",
        "unconfirmed",
        "valid_until",
        "would_block",
        "end_request",
    },
    "Lock": {"cancel_on_lost", "fair", "kind", "limit", "renew", "retry", "shared"},
    "Leadership": {"take", "resign"},
}


def _public(cls: type) -> set[str]:
    names = {name for name in dir(cls) if not name.startswith("_")}
    return names | ({"__enter__", "__exit__", "__aenter__", "__aexit__"} & set(dir(cls)))


@pytest.mark.parametrize(
    "name", ["Coordinator", "Lock", "Lease", "ReadWriteLock", "Election", "Leadership", "Term"]
)
def test_every_call_keeps_its_async_twins_arguments_and_defaults(name: str) -> None:
    """The blocking class has each public member of its async twin (renamed where a
    blocking name is Python's: close, __enter__), with the same parameters, kinds and
    defaults; the differences are the declared ones."""
    sync_cls = getattr(asynclock.sync, name)
    async_cls = getattr(asynclock, name)
    async_members = _public(async_cls) - _INTERNAL.get(name, set())
    sync_members = _public(sync_cls)
    expected = {_RENAMED.get(member, member) for member in async_members}
    assert sync_members - _ONLY_SYNC.get(name, set()) >= expected, expected - sync_members
    for member in sorted(async_members):
        twin = getattr(sync_cls, _RENAMED.get(member, member))
        original = getattr(async_cls, member)
        if not callable(original) or isinstance(original, type):
            continue
        if name == "Term" or member in ("__aexit__", "__aenter__"):
            continue
        ours = inspect.signature(twin).parameters
        theirs = inspect.signature(original).parameters
        added = _ADDED.get((name, member), set())
        assert [p for p in ours if p not in added] == list(theirs), member
        for parameter in theirs.values():
            mine = ours[parameter.name]
            assert (mine.kind, mine.default) == (parameter.kind, parameter.default), (
                f"{name}.{member}({parameter.name})"
            )
    assert list(inspect.signature(asynclock.sync.connect).parameters) == list(
        inspect.signature(asynclock.connect).parameters
    )


_BAD_CALLS: list[tuple[str, Callable[[Any], Any]]] = [
    ("ttl zero", lambda c: c.lock("x", ttl=0)),
    ("ttl nan", lambda c: c.lock("x", ttl=float("nan"))),
    ("name not str", lambda c: c.lock(42)),
    ("empty name", lambda c: c.lock("")),
    ("timeout negative", lambda c: c.lock("x", timeout=-1)),
    ("renew not bool", lambda c: c.lock("x", renew=1)),
    ("retry not Backoff", lambda c: c.lock("x", retry=3)),
    ("fair and shared", lambda c: c.lock("x", fair=True, shared=True)),
    ("limit zero", lambda c: c.semaphore("x", 0)),
    ("limit bool", lambda c: c.semaphore("x", True)),
    ("rwlock ttl", lambda c: c.rwlock("x", ttl=-1)),
    ("election ttl", lambda c: c.election("x", ttl=0)),
    ("election identity", lambda c: c.election("x", identity="")),
    ("singleton ttl", lambda c: c.singleton("x", ttl=0)),
    ("locked ttl", lambda c: c.locked("x", ttl=0)),
]


@pytest.mark.parametrize(("label", "call"), _BAD_CALLS, ids=[label for label, _ in _BAD_CALLS])
def test_bad_input_raises_what_the_async_twin_raises(
    label: str, call: Callable[[Any], Any]
) -> None:
    """The same bad call raises the same error, with the same message, in both APIs."""
    errors = []
    sync_coord = asynclock.sync.connect("memory://bad-input")
    async_coord = asynclock.connect("memory://bad-input")
    for coord in (sync_coord, async_coord):
        with pytest.raises((TypeError, ValueError)) as caught:
            call(coord)
        errors.append((type(caught.value), str(caught.value)))
    sync_coord.close()
    assert errors[0] == errors[1], label


def test_connect_raises_what_the_async_connect_raises() -> None:
    """Unsupported targets, unknown options and too few Redlock nodes fail alike."""
    for args, options in (
        (("ftp://x",), {}),
        (("memory://",), {"nope": 1}),
        ((["redis://a", "redis://b"],), {}),
        ((42,), {}),
    ):
        caught = []
        for connect in (asynclock.sync.connect, asynclock.connect):
            with pytest.raises((TypeError, ValueError)) as error:
                connect(*args, **options)  # type: ignore[arg-type]
            caught.append((type(error.value), str(error.value)))
        assert caught[0] == caught[1]


def test_the_blocking_module_names_its_classes() -> None:
    """Reprs and tracebacks name asynclock.sync, and every public name is documented."""
    for name in asynclock.sync.__all__:
        obj = getattr(asynclock.sync, name)
        assert obj.__doc__, name
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            assert obj.__module__ == "asynclock.sync", name
    assert Path(asynclock.sync.__file__).name == "__init__.py"


def test_call_runs_the_async_api_on_the_loop_thread(make_sync: Callable[..., Any]) -> None:
    """coord.call() reaches what has no blocking twin; its errors come through as is."""
    coord: asynclock.sync.Coordinator = make_sync()
    with coord.lock("c", ttl=5) as lease:
        info = coord.call(coord.aio.inspect, "c")
        assert info is not None
        assert info.fence == lease.fence
    with pytest.raises(TypeError, match="callback"):
        coord.call(coord.aio.election("e").run, 0)


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asynclock-loop")]


def test_a_second_close_waits_for_the_first(
    make_sync: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() from two threads at once: the second returns once the first has closed
    everything (the async twin's later aclose() waits for the first)."""
    coord: asynclock.sync.Coordinator = make_sync()
    lease = coord.lock("slow", ttl=10).acquire()
    core = coord.aio
    original = core.aclose

    async def slow_aclose() -> None:
        import asyncio  # noqa: PLC0415 - the loop thread's clock

        await asyncio.sleep(0.5)
        await original()

    monkeypatch.setattr(core, "aclose", slow_aclose)
    before = set(_loop_threads())
    first = threading.Thread(target=coord.close)
    first.start()
    time.sleep(0.1)
    coord.close()
    assert not lease.held
    assert not (set(_loop_threads()) & before)
    first.join(10)


def test_close_from_a_loss_callback(make_sync: Callable[..., Any]) -> None:
    """A loss callback may close the coordinator: the close neither waits for the
    callback's own thread nor leaves the loop thread behind."""
    coord: asynclock.sync.Coordinator = make_sync()
    closed = threading.Event()
    took: list[float] = []

    def close(_: asynclock.sync.Lease) -> None:
        began = time.monotonic()
        coord.close()
        took.append(time.monotonic() - began)
        closed.set()

    lease = coord.lock("cb", ttl=0.3, renew=False, on_lost=close).acquire()
    assert closed.wait(10)
    assert took[0] < 5
    assert coord.closed
    assert wait_until(lambda: not any(t.is_alive() for t in _loop_threads()), 5)
    assert lease.lost


@pytest.mark.filterwarnings("ignore:This process .* fork:DeprecationWarning")
@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_elections_and_blocks_across_a_fork(make_sync: Callable[..., Any]) -> None:
    """Objects made before a fork work in the child: a Leadership leads and resigns on
    the child's connections; a Lock whose block the parent's thread was inside when it
    forked is, for the child, a lock someone else holds."""
    coord: asynclock.sync.Coordinator = make_sync()
    leadership = coord.election("forked", ttl=5).leadership()
    lock = coord.lock("inside", ttl=10, timeout=0.2)
    with lock:  # the parent uses the coordinator (loop thread, connections) and forks
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                signal.alarm(60)
                with leadership as term:
                    assert not term.lost
                    assert coord.election("forked").leader() == coord.identity
                assert coord.election("forked").leader() is None
                # The parent's block is not the child's: the child waits for the lock
                # as anyone else (it is the parent's), not "already held by this thread".
                with pytest.raises(asynclock.LockTimeout), lock:
                    pass
                coord.close()
                status = 0
            except BaseException:
                import traceback  # noqa: PLC0415 - the child's report

                traceback.print_exc()
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    with leadership as term:  # and the parent's objects still work in the parent
        assert term.fence > 0


def test_an_exception_raised_into_a_blocks_exit_gives_the_lease_back(
    make_sync: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception raised into the thread as its block ends, before the release was on
    its way (Celery's SoftTimeLimitExceeded is an Exception, not a KeyboardInterrupt),
    still gives the lease back, and the thread can take the lock again."""
    coord: asynclock.sync.Coordinator = make_sync()
    lock = coord.lock("exit", ttl=10)

    def raise_now(*_: object) -> None:
        raise ArithmeticError("raised into the thread")

    monkeypatch.setattr(asynclock.sync.Lease, "end_block", raise_now)
    with pytest.raises(ArithmeticError), lock:
        pass
    monkeypatch.undo()
    assert wait_until(lambda: not coord.is_locked("exit"))
    with lock:
        pass


@pytest.mark.filterwarnings("ignore:This process .* fork:DeprecationWarning")
@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_child_leaving_the_parents_block_leaves_the_parents_lock_alone(
    make_sync: Callable[..., Any],
) -> None:
    """A child forked inside a block that then leaves it (its own exit of the parent's
    ``with``) hears LockLost, and never releases the parent's lock: the parent still
    holds it, on the server too."""
    coord: asynclock.sync.Coordinator = make_sync()
    watcher: asynclock.sync.Coordinator = make_sync()
    lock = coord.lock("kept", ttl=10)
    with lock as lease:
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                signal.alarm(60)
                assert not coord.is_locked("nothing")  # the child's own loop runs
                try:
                    lock.__exit__(None, None, None)
                except asynclock.LockLost:
                    status = 0
                time.sleep(0.5)  # room for anything sent in the background
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert lease.held
        info = watcher.inspect("kept")
        assert info is not None
        assert info.fence == lease.fence


@pytest.mark.parametrize("step", ["elected", "resigned"])
async def test_a_cancel_while_a_term_is_announced_gives_the_lease_back(
    namespace: str, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """The blocking API's leadership takes and resigns terms through
    ``Leadership.take()`` / ``resign()``; a cancel landing in the announcement between
    the grant and the caller (or between the body's end and the release) ends
    cancelled, and the lease is given back."""
    import asyncio  # noqa: PLC0415 - this test's loop

    announcing = asyncio.Event()
    original = asynclock.Election._publish

    async def stuck(self: asynclock.Election, kind: str, fence: int) -> None:
        if kind != step:
            await original(self, kind, fence)
            return
        announcing.set()
        await asyncio.Event().wait()  # never answers

    monkeypatch.setattr(asynclock.Election, "_publish", stuck)
    async with asynclock.connect(f"memory://{namespace}") as coord:
        leadership = coord.election("e", ttl=5).leadership()
        task: asyncio.Task[object]
        if step == "elected":
            task = asyncio.create_task(leadership.take())
        else:
            term = await leadership.take()
            task = asyncio.create_task(leadership.resign(term, None))
        await asyncio.wait_for(announcing.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert coord.held == []
        assert await coord.inspect("election:e") is None
