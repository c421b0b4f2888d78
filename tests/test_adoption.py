"""What a first user meets: one identity per coordinator, public types for what they
hold, backends loaded when a URL needs them, and connect() mistakes named at the call."""

from __future__ import annotations

import inspect
import subprocess
import sys
import typing

import pytest
from pytest_asynclock.proxy import FaultProxy

import asynclock
import asynclock.backends


def _classes(annotation: object) -> list[type]:
    """The classes an annotation names, generics' arguments included."""
    found: list[type] = [annotation] if isinstance(annotation, type) else []
    origin = typing.get_origin(annotation)
    if isinstance(origin, type):
        found.append(origin)
    for arg in typing.get_args(annotation):
        found += _classes(arg)
    return found


class TestIdentity:
    async def test_an_election_leads_as_its_coordinator(self) -> None:
        """A candidate without an identity of its own leads as connect(identity=...)."""
        async with asynclock.connect("memory://", identity="api-7") as coord:
            election = coord.election("scheduler", ttl=5)
            assert election.identity == "api-7"
            async with election.leadership() as term:
                assert term.identity == "api-7"
                assert await election.leader() == "api-7"
            assert coord.election("other", identity="worker-2").identity == "worker-2"


class TestPublicTypes:
    def test_what_users_hold_is_public(self) -> None:
        """Every asynclock class a public method returns is a name of asynclock (or of
        asynclock.backends), not of a private module."""
        private = []
        for name in asynclock.__all__:
            cls = getattr(asynclock, name)
            if not isinstance(cls, type):
                continue
            for member, value in inspect.getmembers(cls):
                if member.startswith("_") and member != "__aenter__":
                    continue
                function = value.fget if isinstance(value, property) else value
                if not callable(function):
                    continue
                hints = typing.get_type_hints(function)
                for returned in _classes(hints.get("return")):
                    if not returned.__module__.startswith("asynclock"):
                        continue
                    public = (asynclock, asynclock.backends)
                    if not any(getattr(m, returned.__name__, None) is returned for m in public):
                        private.append(f"{name}.{member} -> {returned.__qualname__}")
        assert private == []


class TestLazyDrivers:
    @pytest.mark.parametrize(
        ("url", "loaded", "absent"),
        [
            ("", [], ["redis", "asyncpg"]),
            ("redis://127.0.0.1:6379/0", ["redis"], ["asyncpg"]),
            ("postgresql://app@127.0.0.1:5432/app", ["asyncpg"], ["redis"]),
        ],
        ids=["import", "redis", "postgresql"],
    )
    def test_a_url_loads_its_driver_only(
        self, url: str, loaded: list[str], absent: list[str]
    ) -> None:
        """import asynclock loads no driver; connect() loads the one its URL needs."""
        script = (
            "import sys, asynclock\n"
            f"if {url!r}: asynclock.connect({url!r})\n"
            f"print(*[m for m in {[*loaded, *absent]!r} if m in sys.modules])\n"
        )
        done = subprocess.run(  # noqa: S603 - our own interpreter and a fixed script
            [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == loaded

    def test_the_pytest_plugin_loads_nothing_heavy(self) -> None:
        """Loading pytest-asynclock's plugin imports neither asynclock, redis-py nor
        asyncpg: a project pays for them only when a fixture is used."""
        script = (
            "import sys, pytest_asynclock.plugin, pytest_asynclock\n"
            "pytest_asynclock.__all__  # the names are listed without importing them\n"
            "print(*[m for m in ('asynclock', 'redis', 'asyncpg') if m in sys.modules])\n"
        )
        done = subprocess.run(  # noqa: S603 - our own interpreter and a fixed script
            [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == []

    def test_a_missing_driver_names_its_extra(self) -> None:
        """Without redis-py or asyncpg installed, connect() says which extra brings it;
        memory:// needs neither."""
        script = (
            "import sys\n"
            "sys.modules['redis'] = sys.modules['asyncpg'] = None  # as if not installed\n"
            "import asynclock\n"
            "for target in ('redis://127.0.0.1:6379/0', ['redis://a:1', 'redis://b:1', "
            "'redis://c:1'], 'postgresql://app@127.0.0.1/app'):\n"
            "    try:\n"
            "        asynclock.connect(target)\n"
            "    except ModuleNotFoundError as exc:\n"
            "        print(exc.name, '|', exc)\n"
            "asynclock.connect('memory://')\n"
        )
        done = subprocess.run(  # noqa: S603 - our own interpreter and a fixed script
            [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert len(lines) == 3, done.stdout
        assert lines[0].startswith("redis |")
        assert "asynclock[redis]" in lines[0]
        assert lines[1].startswith("redis |")
        assert "Redlock" in lines[1]
        assert lines[2].startswith("asyncpg |")
        assert "asynclock[postgres]" in lines[2]


class TestConnectMistakes:
    @pytest.mark.parametrize(
        ("target", "option", "meant"),
        [
            ("redis://127.0.0.1:6379/0", "max_conections", "max_connections"),
            ("rediss://127.0.0.1:6379/0", "socket_timout", "socket_timeout"),
            ("redis+sentinel://127.0.0.1:26379/main", "max_conections", "max_connections"),
            ("redis+cluster://127.0.0.1:7000", "max_conections", "max_connections"),
            ("postgresql://app@127.0.0.1:5432/app", "namspace", "namespace"),
            ("memory://", "drift_bse", "drift_base"),
            ([f"redis://127.0.0.1:{port}/0" for port in (1, 2, 3)], "node_timout", "node_timeout"),
        ],
        ids=["redis", "rediss", "sentinel", "cluster", "postgresql", "memory", "redlock"],
    )
    def test_a_misspelt_option_is_named(self, target: str, option: str, meant: str) -> None:
        """connect() names a misspelt option, the one meant and what it accepts."""
        with pytest.raises(TypeError) as caught:
            asynclock.connect(target, **{option: 5})
        message = str(caught.value)
        assert "unknown option for" in message
        assert f"{option!r} (did you mean {meant!r}?)" in message
        assert "identity" in message
        assert "AbstractConnection" not in message

    async def test_sentinel_kwargs_are_merged_with_the_sentinel_options(self) -> None:
        """``sentinel_kwargs`` (redis-py's options for the sentinels themselves) is
        accepted and used beside the URL's, not passed twice to redis-py."""
        coord = asynclock.connect(
            "redis+sentinel://s:pw@127.0.0.1:26379/main",
            sentinel_kwargs={"socket_timeout": 0.25},
            socket_timeout=2,
        )
        try:
            sentinel = coord.backend.client.connection_pool.asynclock_sentinel  # type: ignore[attr-defined]
            assert sentinel.sentinel_kwargs["socket_timeout"] == 0.25
        finally:
            await coord.aclose()
        with pytest.raises(TypeError, match="sentinel_kwargs must be a dict, got int"):
            asynclock.connect("redis+sentinel://127.0.0.1:26379/main", sentinel_kwargs=5)

    def test_redlock_refuses_one_address_listed_twice(self) -> None:
        """Redlock over one address listed more than once is refused at connect()."""
        urls = ["redis://127.0.0.1:6379/0", "redis://LOCALHOST:6380/0", "redis://127.0.0.1:6379/1"]
        with pytest.raises(ValueError, match=r"listed more than once: 127\.0\.0\.1:6379 \(2"):
            asynclock.connect(urls)

    async def test_redlock_refuses_one_server_under_three_addresses(
        self, asynclock_redis_url: str, namespace: str
    ) -> None:
        """Three addresses of one server (same run_id) fail the first acquire, and
        nothing is left locked."""
        async with (
            FaultProxy.from_url(asynclock_redis_url) as first,
            FaultProxy.from_url(asynclock_redis_url) as second,
        ):
            urls = [asynclock_redis_url, first.url_for(asynclock_redis_url)]
            urls.append(second.url_for(asynclock_redis_url))
            async with asynclock.connect(urls, prefix=namespace, node_timeout=1.0) as coord:
                with pytest.raises(ValueError, match="one server"):
                    await coord.lock("job", ttl=5, timeout=0).acquire()
                with pytest.raises(ValueError, match="one server"):
                    await coord.lock("job", ttl=5, timeout=0).acquire()
                async with asynclock.connect(asynclock_redis_url, prefix=namespace) as single:
                    assert not await single.is_locked("job")
