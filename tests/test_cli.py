"""The ``asynclock`` command, run as a subprocess against the test servers."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pytest_asynclock import ValkeyFactory

import asynclock

EXIT_HELD, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_FREE = 0, 1, 2, 3
PEERS = (
    "redis-py Lock (sleep=0.1)",
    "redis-py Lock (sleep=0.001)",
    "python-redis-lock (sync)",
    "pottery AIORedlock 1 node",
    "aioredlock 1 node",
)


def cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run ``python -m asynclock ARGS`` and capture what it prints."""
    return subprocess.run(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "asynclock", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


async def acli(*args: str) -> subprocess.CompletedProcess[str]:
    """:func:`cli` off the event loop, so held leases keep being renewed meanwhile."""
    return await asyncio.to_thread(cli, *args)


@pytest.fixture
def name() -> str:
    """A lock name unique to the test."""
    return f"cli:{uuid.uuid4().hex[:10]}"


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def finite_numbers(value: Any) -> Iterator[float]:
    """Every number in a JSON document."""
    if isinstance(value, dict):
        for item in value.values():
            yield from finite_numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from finite_numbers(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield float(value)


class TestInspect:
    async def test_redis_held_then_free(self, asynclock_redis_url: str, name: str) -> None:
        """On Redis, inspect shows holder, TTL and fence (exit 0), then 'free' (exit 3)."""
        prefix = f"t{uuid.uuid4().hex[:8]}"
        url = asynclock_redis_url
        async with asynclock.connect(url, prefix=prefix, identity="holder-7") as coord:
            async with coord.lock(name, ttl=30) as lease:
                held = await acli("inspect", name, "--url", url, "--prefix", prefix)
            free = await acli("inspect", name, "--url", url, "--prefix", prefix)
        assert held.returncode == EXIT_HELD, held.stderr
        assert f"{name}: held by holder-7, expires in" in held.stdout
        assert f"fence {lease.fence}" in held.stdout
        assert free.returncode == EXIT_FREE, free.stderr
        assert free.stdout.strip() == f"{name}: free"

    async def test_postgres_held_then_free(self, asynclock_postgres_dsn: str, name: str) -> None:
        """On PostgreSQL, inspect shows the holder and fence (exit 0), then 'free' (exit 3)."""
        namespace = f"t{uuid.uuid4().hex[:8]}"
        dsn = asynclock_postgres_dsn
        async with asynclock.connect(dsn, namespace=namespace, identity="pg-holder") as coord:
            async with coord.lock(name, ttl=30) as lease:
                held = await acli("inspect", name, "--url", dsn, "--namespace", namespace)
            free = await acli("inspect", name, "--url", dsn, "--namespace", namespace, "--json")
        assert held.returncode == EXIT_HELD, held.stderr
        assert "held by pg-holder" in held.stdout
        assert f"fence {lease.fence}" in held.stdout
        assert free.returncode == EXIT_FREE, free.stderr
        assert json.loads(free.stdout) == {"name": name, "held": False}

    async def test_redlock_list_as_json(self, asynclock_redlock_urls: list[str], name: str) -> None:
        """A comma-separated list of Redis URLs is Redlock; --json prints one object."""
        prefix = f"t{uuid.uuid4().hex[:8]}"
        urls = asynclock_redlock_urls
        coord = asynclock.connect(urls, prefix=prefix, identity="rl")
        async with coord, coord.lock(name, ttl=30) as lease:
            held = await acli(
                "inspect", name, "--url", ",".join(urls), "--prefix", prefix, "--json"
            )
        assert held.returncode == EXIT_HELD, held.stderr
        shown = json.loads(held.stdout)
        assert shown["held"] is True
        assert shown["owner"] == "rl"
        assert shown["fence"] == lease.fence
        assert 0 < shown["expires_in"] <= 30

    def test_memory_is_free(self) -> None:
        """memory:// has nothing held in a fresh process: 'free', exit 3."""
        done = cli("inspect", "anything", "--url", "memory://")
        assert done.returncode == EXIT_FREE, done.stderr
        assert done.stdout.strip() == "anything: free"


class TestErrors:
    @pytest.mark.parametrize(
        "args",
        [
            ("inspect", "x", "--url", "foo://bar"),
            ("inspect", "x", "--url", "redis://127.0.0.1:notaport/0"),
            ("inspect", "", "--url", "memory://"),
            ("bench", "--url", "postgresql://127.0.0.1/db"),
            ("bench", "--redlock", "redis://127.0.0.1:1/0,redis://127.0.0.1:2/0"),
            ("bench", "--only", "nonsense"),
        ],
        ids=["scheme", "port", "empty-name", "pg-as-redis", "two-nodes", "section"],
    )
    def test_bad_usage_exits_2(self, args: tuple[str, ...]) -> None:
        """A URL or option that cannot be used: one line on stderr, exit code 2."""
        done = cli(*args)
        assert done.returncode == EXIT_USAGE
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1
        assert lines[0].startswith("asynclock: error: ")

    def test_unreachable_exits_1_without_password(self, closed_port: int) -> None:
        """A server that does not answer: one line, exit code 1, password not shown."""
        url = f"redis://user:s3cret-pass@127.0.0.1:{closed_port}/0"
        for args in (("inspect", "x", "--url", url), ("bench", "--quick", "--url", url)):
            done = cli(*args)
            assert done.returncode == EXIT_UNREACHABLE
            assert len(done.stderr.strip().splitlines()) == 1
            assert "s3cret-pass" not in done.stderr + done.stdout
            assert "***" in done.stderr

    def test_help_for_every_command(self) -> None:
        """--help works for the command and each subcommand."""
        for args in ((), ("bench",), ("inspect",), ("demo",)):
            done = cli(*args, "--help")
            assert done.returncode == 0
            assert "usage: asynclock" in done.stdout


class TestBench:
    def test_without_the_repository_suite_it_says_where_the_suite_is(self) -> None:
        """An installed asynclock (no benchmarks/ on the path) has a bench command that
        exits 2 and names where the suite lives, instead of failing to import it."""
        script = (
            "import sys\n"
            "sys.modules['benchmarks'] = None  # as in an installed wheel\n"
            "from asynclock.cli import main\n"
            "sys.exit(main(['bench', '--quick']))\n"
        )
        done = subprocess.run(  # noqa: S603 - our own interpreter and a fixed script
            [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert "source repository" in done.stderr, done.stderr

    def test_quick_writes_json_table_and_chart(
        self, asynclock_redis_url: str, tmp_path: Path
    ) -> None:
        """bench --quick on one Redis: every expected case with finite numbers in the JSON,
        each peer measured or reported with a reason, a table on stdout."""
        out, chart = tmp_path / "out.json", tmp_path / "out.png"
        done = cli(
            "bench",
            "--quick",
            "--url",
            asynclock_redis_url,
            "--json",
            str(out),
            "--chart",
            str(chart),
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(out.read_text())
        ids = {row["id"] for row in report["results"]}
        assert {
            "uncontended/memory/floor",
            "uncontended/memory/asynclock",
            "uncontended/redis/ping",
            "uncontended/redis/floor",
            "uncontended/redis/asynclock",
            "strict/redis/8/asynclock",
            "free/redis/8/asynclock",
            "leases/redis",
        } <= ids
        assert all(math.isfinite(x) for x in finite_numbers(report["results"]))
        row = next(r for r in report["results"] if r["id"] == "uncontended/redis/asynclock")
        assert row["median_us"] > 0
        assert row["ratio"] > 0
        labels = {r["label"] for r in report["results"]}
        for peer in PEERS:
            assert peer in labels or peer in report["unavailable"], peer
        statuses = {t["id"]: t["status"] for t in report["targets"]}
        assert statuses["redis_uncontended"] in ("PASS", "MISS")
        assert statuses["postgres"] == "n/a"  # no PostgreSQL given
        assert "Uncontended acquire + release" in done.stdout
        assert "asynclock async with" in done.stdout
        assert "Targets" in done.stdout
        assert chart.exists() or "matplotlib is not installed" in done.stderr

    def test_only_primitives(
        self, asynclock_redis_url: str, asynclock_postgres_dsn: str, tmp_path: Path
    ) -> None:
        """bench --quick --only primitives: per backend, each primitive against the plain
        lock (median, p99, ratio), and fair against plain with 8 waiters; nothing else."""
        out = tmp_path / "out.json"
        done = cli(
            "bench",
            "--quick",
            "--only",
            "primitives",
            "--no-peers",
            "--url",
            asynclock_redis_url,
            "--pg",
            asynclock_postgres_dsn,
            "--json",
            str(out),
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(out.read_text())
        rows = {row["id"]: row for row in report["results"]}
        assert {row["section"] for row in rows.values()} == {"primitives", "primitives-contended"}
        for server in ("memory", "redis", "postgres"):
            assert rows[f"primitives/{server}/lock"]["kind"] == "floor"
            for case in ("semaphore", "rwlock-read", "rwlock-write", "fair"):
                row = rows[f"primitives/{server}/{case}"]
                assert row["floor"] == f"primitives/{server}/lock"
                assert row["median_us"] > 0
                assert row["p99_us"] >= row["median_us"]
                assert row["ratio"] > 0
            for mode in ("strict", "free"):
                fair = rows[f"primitives-{mode}/{server}/8/fair"]
                assert fair["floor"] == f"primitives-{mode}/{server}/8/plain"
                assert fair["handoffs_per_s"] > 0
                assert fair["ratio"] > 0
        assert all(math.isfinite(x) for x in finite_numbers(report["results"]))
        assert "Primitives, uncontended" in done.stdout
        assert "Primitives, contended" in done.stdout

    def test_password_never_printed(
        self, asynclock_valkey_factory: ValkeyFactory, tmp_path: Path
    ) -> None:
        """A password in --url appears neither on the terminal nor in the JSON."""
        (server,) = asynclock_valkey_factory(1)
        # Set after start: the factory's readiness probe does not authenticate.
        admin = redis.Redis.from_url(server.url)
        admin.config_set("requirepass", "hunter2-secret")
        admin.close()
        url = f"redis://:hunter2-secret@127.0.0.1:{server.port}/0"
        out = tmp_path / "out.json"
        done = cli(
            "bench",
            "--quick",
            "--only",
            "uncontended",
            "--no-peers",
            "--url",
            url,
            "--json",
            str(out),
        )
        assert done.returncode == 0, done.stderr
        for text in (done.stdout, done.stderr, out.read_text()):
            assert "hunter2-secret" not in text
        assert json.loads(out.read_text())["servers"]["redis"].startswith("redis://:***@")


def test_demo_quick_shows_a_failover() -> None:
    """demo --quick counts exactly under the lock and hands leadership over twice."""
    done = cli("demo", "--quick", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "end value 12 (expected 12): exact" in done.stdout
    assert done.stdout.count("took over") == 2
    assert len(re.findall(r"candidate-[abc] leads", done.stdout)) == 3
