"""What a first user meets: one identity per coordinator, public types for what they
hold, backends loaded when a URL needs them, and connect() mistakes named at the call."""

from __future__ import annotations

import inspect
import subprocess
import sys
import typing

import pytest

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
