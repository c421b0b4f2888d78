"""asynclock.integrations.celery with real ``celery worker`` processes (prefork and threads
pools) on a real broker: a private Valkey each test starts, which is also the result
backend, the lock server and where the task bodies record their runs (four databases).

The task bodies record each run (when it started, its fence and worker) and then hold
the lock until the test sets their ``go`` key, so a test decides when a run ends
instead of guessing how long a run takes. Every wait polls for a condition with a generous
deadline; nothing asserts how fast the machine is.

The workers import their app from a two-line module the test writes into ``tmp_path``
(``app = make_app()`` from this file), so that the app is type-checked and linted here.
Each worker is a session of its own, stopped by its own PID when the test ends (its
process group too: the prefork children).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery  # type: ignore[import-untyped,unused-ignore]
from celery.exceptions import ImproperlyConfigured  # type: ignore[import-untyped,unused-ignore]
from celery.result import AsyncResult  # type: ignore[import-untyped,unused-ignore]
from pytest_asynclock.servers import ValkeyFactory

import asynclock.sync
from asynclock.integrations.celery import SingletonTask, coordinator_for

ROOT = Path(__file__).resolve().parent.parent

#: The Valkey the worker's app uses, ``redis://127.0.0.1:PORT`` (no database).
SERVER_ENV = "ASYNCLOCK_CELERY_TEST_SERVER"
#: The PID of the test process that started the worker (see :func:`watch_parent`).
PARENT_ENV = "ASYNCLOCK_CELERY_TEST_PARENT"
BROKER_DB, RESULTS_DB, LOCKS_DB, RECORDS_DB = 0, 1, 2, 3

#: The lease of the task the kill test kills: short, since it is renewed.
KILL_TTL = 3.0
#: How long any condition may take to come true on a loaded 2-core machine.
DEADLINE = 60.0
#: How long a task body waits for its ``go`` key at most (then ends by itself).
HOLD_LIMIT = 90.0

#: The module the workers load their app from (``-A celery_test_app``), in ``tmp_path``.
APP_MODULE = (
    "from tests.test_celery import make_app, watch_parent\n\nwatch_parent()\napp = make_app()\n"
)


# -- the app the workers run ----------------------------------------------------------


def make_app(server: str | None = None) -> Celery:
    """The test app: broker, results, locks and records on ``server`` (default: the
    URL in ``ASYNCLOCK_CELERY_TEST_SERVER``), and its four singleton tasks, all running
    :func:`hold`:

    - ``t.skip``: ``on_held="skip"``, lock named from a digest of the arguments;
    - ``t.retry``: ``on_held="retry"`` every 0.3 s;
    - ``t.wait``: ``on_held="wait"``, lock named ``wait:{key}``;
    - ``t.kill``: ``on_held="skip"`` with a lease of :data:`KILL_TTL` seconds.
    """
    server = server or os.environ[SERVER_ENV]
    app = Celery(
        "asynclock_celery_test",
        broker=f"{server}/{BROKER_DB}",
        backend=f"{server}/{RESULTS_DB}",
        set_as_current=False,
    )
    app.conf.update(
        asynclock_url=f"{server}/{LOCKS_DB}",
        broker_connection_retry_on_startup=True,
        task_track_started=True,
        result_expires=None,
    )
    options: dict[str, Any] = {"base": SingletonTask, "bind": True}
    app.task(name="t.skip", lock_ttl=10, **options)(hold)
    app.task(name="t.retry", on_held="retry", lock_retry_delay=0.3, max_retries=200, **options)(
        hold
    )
    app.task(name="t.wait", on_held="wait", lock_name="wait:{key}", **options)(hold)
    app.task(name="t.kill", lock_ttl=KILL_TTL, **options)(hold)
    return app


def watch_parent() -> None:
    """In a worker's main process: ``SIGKILL`` the worker's process group (its pool
    children too) as soon as the test process that started it is gone — a test run
    killed, or crashed, before its teardown leaves no worker behind."""
    parent = int(os.environ[PARENT_ENV])

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


# Per process and server: a forked child makes its own.
_records: dict[tuple[int, str], redis.Redis] = {}


def records(server: str | None = None) -> redis.Redis:
    """The records database (a client per process)."""
    key = (os.getpid(), server or os.environ[SERVER_ENV])
    if key not in _records:
        _records[key] = redis.Redis.from_url(f"{key[1]}/{RECORDS_DB}", decode_responses=True)
    return _records[key]


def hold(task: SingletonTask, key: str) -> dict[str, Any]:
    """A singleton task's body: record the run, hold the lock until the test sets
    ``go:<key>`` (or ``go:all``), and return what the test checks."""
    db = records()
    lease = task.lease
    run = {
        "started": time.time(),
        "fence": lease.fence,
        "lock": lease.name,
        "hostname": task.request.hostname,
        "retries": task.request.retries,
    }
    db.rpush(f"runs:{key}", json.dumps(run))
    limit = time.monotonic() + HOLD_LIMIT
    while not db.exists(f"go:{key}", "go:all") and time.monotonic() < limit:
        time.sleep(0.02)
    lease.check()  # raises LockLost if the lease was lost while the run held it
    return {**run, "ended": time.time()}


# -- workers ----------------------------------------------------------------------------


@dataclass
class Worker:
    """A ``celery worker`` process: a session (and process group) of its own."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        """The worker's main process, leader of its process group."""
        return self.process.pid

    def log_tail(self, lines: int = 40) -> str:
        """The end of the worker's log, for failure messages."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- worker {self.name} (pid {self.pid}) log tail ---\n" + "\n".join(
            text.splitlines()[-lines:]
        )

    def ready(self) -> bool:
        """True once the worker said it is ready (it consumes); fails if it exited."""
        if self.process.poll() is not None:
            pytest.fail(
                f"worker {self.name} exited with {self.process.returncode}\n{self.log_tail()}"
            )
        return self.log.exists() and " ready." in self.log.read_text(errors="replace")

    def kill(self) -> None:
        """``kill -9`` the worker's whole process group (main process and pool children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """Warm shutdown (``SIGTERM`` to the main process), then ``SIGKILL`` to the group
        after a bound; leaves no process of the group behind."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(15)
        # Pool children outlive a main process that was killed: SIGKILL whatever is left
        # of the group (the group id is the worker's own PID, reserved while any member
        # lives).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


@dataclass
class Cluster:
    """The test's Valkey, its app (to send tasks and read results) and its workers."""

    server: str
    app: Celery
    tmp_path: Path
    workers: list[Worker]
    sent: list[str]

    @property
    def db(self) -> redis.Redis:
        """The records database."""
        return records(self.server)

    def start(self, name: str, pool: str, concurrency: int = 4) -> Worker:
        """Start a worker and return at once (it consumes when it is ready)."""
        log = self.tmp_path / f"worker-{name}.log"
        env = {
            **os.environ,
            SERVER_ENV: self.server,
            PARENT_ENV: str(os.getpid()),
            "PYTHONPATH": os.pathsep.join(
                [str(self.tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]
            ),
        }
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_test_app",
            "worker",
            f"--pool={pool}",
            f"--concurrency={concurrency}",
            "--loglevel=INFO",
            f"--hostname={name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        with log.open("wb") as out:
            process = subprocess.Popen(  # noqa: S603 - our own interpreter and app
                command,
                cwd=self.tmp_path,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name, process, log)
        self.workers.append(worker)
        return worker

    def send(self, task: str, key: str) -> AsyncResult:
        """Send ``task(key)``."""
        result = self.app.send_task(task, args=[key])
        self.sent.append(result.id)
        return result

    def runs(self, key: str) -> list[dict[str, Any]]:
        """The runs of ``key`` so far, oldest first."""
        return [json.loads(run) for run in self.db.lrange(f"runs:{key}", 0, -1)]

    def go(self, key: str) -> None:
        """Let the runs of ``key`` end."""
        self.db.set(f"go:{key}", 1)

    def wait_for(
        self,
        what: str,
        condition: Callable[[], bool],
        deadline: float = DEADLINE,
        every: float = 0.05,
    ) -> None:
        """Poll ``condition`` every ``every`` seconds until true; fail after ``deadline``
        seconds, with the workers' logs."""
        end = time.monotonic() + deadline
        while not condition():
            if time.monotonic() > end:
                logs = "\n".join(worker.log_tail() for worker in self.workers)
                pytest.fail(f"not within {deadline:g} s: {what}\n{logs}")
            time.sleep(every)


@pytest.fixture
def cluster(asynclock_valkey_factory: ValkeyFactory, tmp_path: Path) -> Iterator[Cluster]:
    """A private Valkey and the test's app; the workers the test starts are stopped, by
    PID and process group, when it ends (their held runs let go first)."""
    (server_process,) = asynclock_valkey_factory(1)
    server = server_process.url.rsplit("/", 1)[0]
    (tmp_path / "celery_test_app.py").write_text(APP_MODULE)
    app = make_app(server)
    made = Cluster(server, app, tmp_path, [], [])
    try:
        yield made
    finally:
        with contextlib.suppress(redis.RedisError):
            made.db.set("go:all", 1)
        for worker in made.workers:
            worker.stop()
        # Sending a task subscribes this process to its result; unsubscribe while the
        # server is up. Otherwise a result still referenced (by a failure's traceback)
        # unsubscribes when collected, in a later test, and retries the dead server for
        # 20 s there.
        with contextlib.suppress(Exception):
            for task_id in made.sent:
                app.backend.result_consumer.cancel_for(task_id)
        app.close()
        _records.pop((os.getpid(), server)).close()


def results(cluster: Cluster, items: list[AsyncResult]) -> list[Any]:
    """The return values of the tasks ``items``, once all finished (polled, so that a
    timeout shows the workers' logs); fails the test if one failed."""
    cluster.wait_for(f"{len(items)} task(s) finished", lambda: all(item.ready() for item in items))
    for item in items:
        if item.failed():
            pytest.fail(f"task {item.id} failed: {item.result!r}\n{item.traceback}")
    return [item.result for item in items]


# -- the tests --------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_twenty_sends_run_once(cluster: Cluster, pool: str) -> None:
    """The same task sent 20 times at once runs once (skip policy: the other 19 return
    None without running, while the first holds the lock); other arguments run apart."""
    cluster.start("w", pool)
    same = [cluster.send("t.skip", "same") for _ in range(20)]
    other = cluster.send("t.skip", "other")

    def skipped() -> list[AsyncResult]:
        return [item for item in same if item.ready()]

    # Fails at once if a second run starts (a broken lock), else when 19 were skipped.
    cluster.wait_for(
        "19 of the 20 sends skipped, one running",
        lambda: len(cluster.runs("same")) > 1 or len(skipped()) == 19,
    )
    assert len(cluster.runs("same")) == 1
    assert results(cluster, skipped()) == [None] * 19
    running = [item for item in same if not item.ready()]
    assert len(running) == 1
    cluster.wait_for("the other argument runs", lambda: len(cluster.runs("other")) == 1)

    cluster.go("same")
    cluster.go("other")
    (done,) = results(cluster, running)
    (run,) = cluster.runs("same")
    assert done["fence"] == run["fence"]
    assert done["lock"].startswith("celery:t.skip:")
    (other_run,) = cluster.runs("other")
    assert results(cluster, [other])[0]["fence"] == other_run["fence"]
    assert other_run["lock"] != run["lock"]
    # Released when the run ended: a new send runs again.
    again = cluster.send("t.skip", "same")
    assert results(cluster, [again])[0]["fence"] > run["fence"]
    assert len(cluster.runs("same")) == 2


def test_retry_and_wait_policies(cluster: Cluster) -> None:
    """``on_held="retry"``: a send that finds the lock held is retried until the holder
    ended, then runs. ``on_held="wait"``: it waits for the lock in the worker, then runs."""
    cluster.start("w", "threads")
    first_retry = cluster.send("t.retry", "r")
    first_wait = cluster.send("t.wait", "w")
    cluster.wait_for(
        "both first runs hold", lambda: len(cluster.runs("r")) == len(cluster.runs("w")) == 1
    )
    second_retry = cluster.send("t.retry", "r")
    second_wait = cluster.send("t.wait", "w")

    # The second retry send was refused and scheduled again; the second wait send
    # started and waits for the lock.
    cluster.wait_for(
        "the second retry send retries",
        lambda: second_retry.state in {"RETRY", "SUCCESS", "FAILURE"} or len(cluster.runs("r")) > 1,
    )
    cluster.wait_for(
        "the second wait send started",
        lambda: second_wait.state == "STARTED" or len(cluster.runs("w")) > 1,
    )
    time.sleep(0.5)  # time for a broken policy to run them now (it would: they are sent)
    assert second_retry.state == "RETRY"
    assert len(cluster.runs("r")) == 1
    assert len(cluster.runs("w")) == 1

    cluster.go("r")
    cluster.go("w")
    r1, r2, w1, w2 = results(cluster, [first_retry, second_retry, first_wait, second_wait])
    assert [run["fence"] for run in cluster.runs("r")] == [r1["fence"], r2["fence"]]
    assert [run["fence"] for run in cluster.runs("w")] == [w1["fence"], w2["fence"]]
    # One after the other, never together.
    assert r2["started"] >= r1["ended"]
    assert w2["started"] >= w1["ended"]
    assert r2["fence"] > r1["fence"]
    assert w2["fence"] > w1["fence"]
    assert r2["retries"] >= 1  # it ran as a retry
    assert w2["retries"] == 0  # it waited: no retry
    assert w2["lock"] == "wait:w"  # named from the template


def test_killed_worker_frees_the_job_within_the_ttl(cluster: Cluster) -> None:
    """The lease of a run is renewed while it works (it holds past its TTL, and the same
    task sent meanwhile is skipped); a worker killed with ``kill -9`` stops renewing it:
    the same task, sent again, runs on another worker once the lease ran out — within
    the TTL (plus a margin for a loaded machine), not an hour — and not before."""
    workers = {name: cluster.start(name, "prefork", concurrency=2) for name in ("a", "b")}
    cluster.wait_for("both workers ready", lambda: all(w.ready() for w in workers.values()))
    first = cluster.send("t.kill", "k")
    cluster.wait_for("the first run holds the lock", lambda: len(cluster.runs("k")) == 1)
    (run,) = cluster.runs("k")
    victim = next(w for name, w in workers.items() if run["hostname"].startswith(f"{name}@"))

    with asynclock.sync.connect(f"{cluster.server}/{LOCKS_DB}") as probe:
        # Renewed: the run holds its lock well past one TTL, and the job sent again
        # meanwhile (a scheduler's next tick, a user's click) is skipped.
        during: list[AsyncResult] = []
        held_until = time.monotonic() + 1.5 * KILL_TTL

        holders: list[int | None] = []  # the holder's fence at each look (None: free)

        def held_past_ttl() -> bool:
            info = probe.inspect(run["lock"])
            holders.append(None if info is None else info.fence)
            during.append(cluster.send("t.kill", "k"))
            if holders[-1] != run["fence"] or len(cluster.runs("k")) > 1:
                return True  # broken: fail now
            return time.monotonic() > held_until

        cluster.wait_for("the run held past its TTL", held_past_ttl, every=0.2)
        assert set(holders) == {run["fence"]}, "the lock changed hands while its run worked"
        assert len(cluster.runs("k")) == 1
        assert results(cluster, during) == [None] * len(during)

        asked = time.time()
        info = probe.inspect(run["lock"])
        assert info is not None
        assert info.fence == run["fence"]
        # The lease ends on the server no sooner than this (later if renewed meanwhile).
        free_at_earliest = asked + info.expires_in
        killed = time.time()
        victim.kill()

        # Sent again and again: skipped while the dead run's lease lasts, run once it ran
        # out.
        after: list[AsyncResult] = []

        def rerun() -> bool:
            after.append(cluster.send("t.kill", "k"))
            return len(cluster.runs("k")) > 1

        cluster.wait_for("a run after the kill", rerun, deadline=KILL_TTL + DEADLINE, every=0.2)
        second = cluster.runs("k")[1]
        took = second["started"] - killed
        assert 0 < took < KILL_TTL + 15.0, took  # within the TTL (+ a generous margin)
        assert second["started"] >= free_at_earliest - 0.05  # not before the lease ran out
        assert second["fence"] > run["fence"]
        assert not second["hostname"].startswith(f"{victim.name}@")
        assert not first.ready()  # the killed run never reported (early ack: lost with it)

    # Every send after the kill but the running one was skipped (before or during it).
    cluster.wait_for(
        "the sends around the second run skipped",
        lambda: sum(not item.ready() for item in after) == 1,
    )
    cluster.go("k")
    outcomes = results(cluster, after)
    assert [o["fence"] for o in outcomes if o is not None] == [second["fence"]]
    assert len(cluster.runs("k")) == 2


# -- in this process: options, names, policies (eager runs, no worker) -------------------


@pytest.fixture
def eager_app(asynclock_redis_url: str, namespace: str) -> Iterator[Celery]:
    """An app whose locks live on the session's server, under a prefix of this test's."""
    app = Celery("asynclock_celery_unit", set_as_current=False)
    app.conf.update(asynclock_url=asynclock_redis_url, asynclock_options={"prefix": namespace})
    yield app
    coordinator_for(app).close()
    app.close()


def probe_task(app: Celery, name: str, **options: Any) -> Any:
    """A singleton task ``name`` of ``app`` returning its lease's name and fence."""

    def probe(self: SingletonTask, day: str, shop: int = 1) -> tuple[str, int]:
        return self.lease.name, self.lease.fence

    return app.task(name=name, base=SingletonTask, bind=True, lazy=False, **options)(probe)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"on_held": "sikp"}, ValueError, "on_held must be one of 'skip', 'retry', 'wait'"),
        ({"lock_ttl": 0}, ValueError, "lock_ttl must be > 0"),
        ({"lock_ttl": "60"}, TypeError, "lock_ttl must be a number"),
        ({"lock_timeout": -1}, ValueError, "lock_timeout must be >= 0"),
        ({"lock_retry_delay": float("nan")}, ValueError, "lock_retry_delay must be finite"),
        ({"lock_tll": 60}, TypeError, "unknown option lock_tll="),
        ({"lock_name": "report:{month}"}, ValueError, "names 'month'.*parameters: day, shop"),
        ({"lock_name": "report:{}"}, ValueError, "name the task's parameters"),
        ({"lock_coordinator": "redis://x"}, TypeError, "asynclock.sync.Coordinator"),
    ],
)
def test_bad_options_fail_when_the_task_is_built(
    eager_app: Celery, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    """A bad option raises when Celery builds the task's class, naming the task."""
    with pytest.raises(error, match=f"task 't.bad': .*{match}"):
        probe_task(eager_app, "t.bad", **options)


def test_lock_names(eager_app: Celery) -> None:
    """The default name is the task's and a digest of the bound arguments (the same
    whether given by position, by keyword or by default); a template is used as is."""
    digest = probe_task(eager_app, "t.digest")
    name = digest.lock_name_for(["2026-12-04"])
    assert name.startswith("celery:t.digest:")
    assert digest.lock_name_for([], {"day": "2026-12-04"}) == name
    assert digest.lock_name_for(["2026-12-04", 1]) == name
    assert digest.lock_name_for(["2026-12-04", 2]) != name
    assert digest.lock_name_for(["2026-12-05"]) != name
    with pytest.raises(TypeError, match="lock_name="):
        digest.lock_name_for([object()])
    template = probe_task(eager_app, "t.template", lock_name="report:{shop}:{day}")
    assert template.lock_name_for(["2026-12-04"]) == "report:1:2026-12-04"


def test_policies_in_eager_runs(
    eager_app: Celery, asynclock_redis_url: str, namespace: str
) -> None:
    """Run in this process (``apply()``): the run holds its lease; when another holder
    has the lock, skip returns None, retry ends in LockTimeout past ``max_retries``, and
    wait waits ``lock_timeout`` then raises LockTimeout."""
    skip = probe_task(eager_app, "t.eager.skip")
    retry = probe_task(eager_app, "t.eager.retry", on_held="retry", max_retries=1)
    wait = probe_task(eager_app, "t.eager.wait", on_held="wait", lock_timeout=0.2)
    name, fence = skip.apply(["d"]).get()
    assert name == skip.lock_name_for(["d"])
    assert fence > 0
    with pytest.raises(RuntimeError, match="only while the task runs"):
        _ = skip.lease
    with asynclock.sync.connect(asynclock_redis_url, prefix=namespace) as other:
        for task in (skip, retry, wait):
            with other.lock(task.lock_name_for(["d"]), ttl=30):
                if task is skip:
                    assert task.apply(["d"]).get() is None
                    assert task("d") is None  # a direct call too
                else:
                    with pytest.raises(asynclock.LockTimeout):
                        task.apply(["d"]).get()
            assert task.apply(["d"]).get()[1] > fence  # free again: runs


class _Raised(Exception):
    """Stands for Celery's SoftTimeLimitExceeded, raised into the thread on any line."""


@pytest.mark.parametrize("where", ["before the body", "after the body, before leaving"])
def test_an_exception_raised_into_a_run_gives_the_lock_back(
    eager_app: Celery, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A soft time limit that lands between the grant and the body, or after the body
    returned and before its block was left, still gives the lease back (it stayed held,
    and renewed, until the worker process exited)."""
    import asynclock.integrations.celery as integration  # noqa: PLC0415 - the seam patched
    import asynclock.sync._decorators as decorators  # noqa: PLC0415 - the seam patched

    task = probe_task(eager_app, "t.raised")

    def raise_now(*_: object) -> None:
        raise _Raised(where)

    if where == "before the body":
        monkeypatch.setattr(integration, "run_held", raise_now)
    else:
        monkeypatch.setattr(decorators, "leave", raise_now)
    with pytest.raises(_Raised):
        task("d")
    monkeypatch.undo()
    coord = coordinator_for(eager_app)
    name = task.lock_name_for(["d"])
    deadline = time.monotonic() + 10
    while coord.is_locked(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not coord.is_locked(name)
    assert task("d")[0] == name  # and the thread can run it again (no "already held")


def test_coordinator_from_the_task_or_the_config(asynclock_redis_url: str, namespace: str) -> None:
    """``lock_coordinator`` wins over the app's config; without either, a run says what
    to configure."""
    app = Celery("asynclock_celery_unconfigured", set_as_current=False)
    with asynclock.sync.connect(asynclock_redis_url, prefix=namespace) as coord:
        given = probe_task(app, "t.given", lock_coordinator=coord)
        name, _ = given.apply(["d"]).get()
        assert name == given.lock_name_for(["d"])
        bare = probe_task(app, "t.bare")
        with pytest.raises(ImproperlyConfigured, match="asynclock_url"):
            bare.apply(["d"]).get()
    app.close()


def test_importing_asynclock_does_not_import_celery() -> None:
    """``asynclock`` and ``asynclock.integrations`` load without Celery; the Celery
    integration without Celery names the extra to install."""
    code = (
        "import sys, asynclock, asynclock.sync, asynclock.integrations\n"
        "assert 'celery' not in sys.modules, 'celery was imported'\n"
        "sys.modules['celery'] = None\n"
        "try:\n"
        "    import asynclock.integrations.celery\n"
        "except ImportError as exc:\n"
        "    assert 'asynclock[celery]' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('imported without celery')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # noqa: S603
