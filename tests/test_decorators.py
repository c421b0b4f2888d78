"""@coord.singleton and @coord.locked, on every backend."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

import pytest

import asynclock

from .conftest import MakeCoord


class TestSingleton:
    async def test_twenty_calls_one_runs(self, make_coord: MakeCoord) -> None:
        """20 concurrent calls of one job (over 2 coordinators): exactly one runs, the
        other 19 are skipped and return None."""
        coords = [make_coord(), make_coord()]
        runs: list[str] = []

        def job_on(coord: asynclock.Coordinator) -> Callable[[str], Awaitable[str | None]]:
            @coord.singleton("report:{day}", ttl=10)
            async def build_report(day: str) -> str:
                runs.append(day)
                await asyncio.sleep(0.3)
                return f"report for {day}"

            return build_report

        jobs = [job_on(coord) for coord in coords]
        results = await asyncio.gather(*(jobs[i % 2]("2026-11-29") for i in range(20)))
        assert runs == ["2026-11-29"]
        assert results.count(None) == 19
        assert "report for 2026-11-29" in results

    async def test_different_names_both_run(self, coord: asynclock.Coordinator) -> None:
        """Calls whose templates give different names do not exclude each other."""

        @coord.singleton("user:{user_id}", ttl=10)
        async def touch(user_id: int, *, note: str = "") -> int:
            await asyncio.sleep(0.05)
            return user_id

        # The type checker sees int | None: a singleton call may be skipped.
        first, second = await asyncio.gather(touch(1), touch(2, note="n"))
        assert (first, second) == (1, 2)


class TestLocked:
    async def test_never_two_at_once(self, make_coord: MakeCoord) -> None:
        """@locked: concurrent calls wait their turn; never two inside at once."""
        coords = [make_coord(), make_coord()]
        inside = 0
        most = 0

        def update_on(coord: asynclock.Coordinator) -> Callable[..., Awaitable[int]]:
            @coord.locked("user:{user_id}", ttl=10, timeout=10)
            async def update_user(user_id: int, delta: int = 1) -> int:
                nonlocal inside, most
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.005)
                inside -= 1
                return user_id + delta

            return update_user

        updates = [update_on(coord) for coord in coords]
        results = await asyncio.gather(*(updates[i % 2](7) for i in range(12)))
        assert results == [8] * 12
        assert most == 1

    async def test_timeout_raises(self, coord: asynclock.Coordinator) -> None:
        """@locked with a timeout raises LockTimeout when the lock stays held."""

        @coord.locked("busy:{key}", ttl=10, timeout=0.1)
        async def work(key: str) -> str:
            return key

        # Held by a lease not tied to this task: re-entering from the task raises instead.
        held = await coord.lock("busy:k").acquire()
        with pytest.raises(asynclock.LockTimeout):
            await work("k")
        await held.release()
        assert await work(key="k") == "k"


class TestTemplates:
    async def test_unknown_parameter_fails_at_decoration(
        self, coord: asynclock.Coordinator
    ) -> None:
        """A template naming a parameter the function does not take fails when decorating,
        naming the parameters it does take."""
        with pytest.raises(ValueError, match=r"user_idd.*user_id"):

            @coord.locked("user:{user_idd}")
            async def update_user(user_id: int) -> None: ...

        with pytest.raises(ValueError, match="name the parameters"):

            @coord.singleton("job:{0}")
            async def job(day: str) -> None: ...

        with pytest.raises(ValueError, match="format"):

            @coord.singleton("job:{day")
            async def job2(day: str) -> None: ...

        with pytest.raises(TypeError, match="async def"):

            @coord.locked("sync:{x}")  # type: ignore[arg-type]
            def sync(x: int) -> None: ...

        with pytest.raises(ValueError, match="ttl"):
            coord.singleton("x", ttl=0)

    async def test_defaults_keywords_and_attributes(self, coord: asynclock.Coordinator) -> None:
        """Templates see defaults and keyword arguments, and may index and use attributes."""
        seen: list[str] = []

        @coord.locked("order:{order.id}:{kind}:{tags[0]}", ttl=5)
        async def process(order: object, tags: list[str], kind: str = "paid") -> None:
            info = await coord.inspect(f"order:7:{kind}:{tags[0]}")
            seen.append("held" if info is not None else "free")

        class Order:
            id = 7

        await process(Order(), tags=["a", "b"])
        await process(Order(), ["x"], kind="refund")
        assert seen == ["held", "held"]

    async def test_signature_and_name_are_kept(self, coord: asynclock.Coordinator) -> None:
        """The decorated function keeps its name, docstring and signature."""

        @coord.locked("doc:{x}")
        async def documented(x: int, y: str = "y") -> str:
            """Docstring stays."""
            return f"{x}{y}"

        assert documented.__name__ == "documented"
        assert documented.__doc__ == "Docstring stays."
        assert list(inspect.signature(documented).parameters) == ["x", "y"]
        assert await documented(1) == "1y"
