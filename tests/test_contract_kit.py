"""The backend contract kit (asynclock.testing.check_backend): every shipped backend keeps
it on a real server, and it fails on backends broken in each way it checks."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import pytest

import asynclock
from asynclock._wakeup import WakeSlot
from asynclock.backends import MemoryBackend
from asynclock.backends.base import Attempt, Backend, Claim, GiveBack, Interrupted, LockInfo
from asynclock.testing import ContractViolation, check_backend

from .conftest import MakeCoord


async def test_every_backend_keeps_the_contract(make_coord: MakeCoord, backend_kind: str) -> None:
    """Memory, Redis, Redlock and PostgreSQL pass every check of the kit."""
    coord = make_coord()
    await check_backend(coord.backend)


class Delegate(Backend):
    """A backend that forwards to a memory backend: broken ones override one method."""

    kinds = MemoryBackend.kinds

    def __init__(self) -> None:
        super().__init__()
        self.inner = MemoryBackend()
        self.clock = self.inner.clock

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        return await self.inner.try_acquire(claim, ttl, wait=wait)

    async def extend(self, claim: Claim, ttl: float) -> bool:
        return await self.inner.extend(claim, ttl)

    async def release(self, claim: Claim) -> bool:
        return await self.inner.release(claim)

    async def inspect(self, name: str) -> LockInfo | None:
        return await self.inner.inspect(name)

    async def owns(self, claim: Claim, fence: int) -> bool:
        return await self.inner.owns(claim, fence)

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        return self.inner.waiter(name)

    async def give_back(self, claim: Claim, interrupted: Interrupted) -> GiveBack:
        return await self.inner.give_back(claim, interrupted)


class Keeps(Delegate):
    """The unbroken delegate: it must pass, or the broken ones prove nothing."""


class ReleasesAnyones(Delegate):
    """Release without an owner check: deletes whoever was granted the name last."""

    def __init__(self) -> None:
        super().__init__()
        self.granted: dict[str, Claim] = {}

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        attempt = await super().try_acquire(claim, ttl, wait=wait)
        if attempt.fence is not None:
            self.granted[claim.name] = claim
        return attempt

    async def release(self, claim: Claim) -> bool:
        return await super().release(self.granted.get(claim.name, claim))


class FenceStandsStill(Delegate):
    """Every grant of a name gets the same fence."""

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        attempt = await super().try_acquire(claim, ttl, wait=wait)
        return attempt if attempt.fence is None else Attempt(1)


class ExtendRevives(Delegate):
    """An extend of an expired lock takes it again."""

    async def extend(self, claim: Claim, ttl: float) -> bool:
        if await super().extend(claim, ttl):
            return True
        return (await self.try_acquire(claim, ttl)).fence is not None


class WakesNobody(Delegate):
    """A waiter registers where no release of its name will ever reach it."""

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        return super().waiter(f"{name}-nowhere")


class KeepsItsPlace(Delegate):
    """A refused fair attempt's place in line outlives the acquire that stopped."""

    async def give_back(self, claim: Claim, interrupted: Interrupted) -> GiveBack:
        if interrupted is Interrupted.ANSWERED:
            return GiveBack(False)
        return await super().give_back(claim, interrupted)


@pytest.mark.parametrize(
    ("broken", "check"),
    [
        (Keeps, None),
        (ReleasesAnyones, "release by the holder only"),
        (FenceStandsStill, "fences increase"),
        (ExtendRevives, "an expired lock is free"),
        (WakesNobody, "a release wakes a waiter"),
        (KeepsItsPlace, "an interrupted acquire is given back"),
    ],
    ids=[
        "unbroken",
        "releases-anyones",
        "fence-stands-still",
        "extend-revives",
        "wakes-nobody",
        "keeps-its-place",
    ],
)
async def test_the_kit_fails_a_broken_backend(broken: type[Delegate], check: str | None) -> None:
    """A backend broken in one way fails the kit at the check for it, with its name; the
    same delegate unbroken passes."""
    backend = broken()
    if check is None:
        await check_backend(backend, ttl=0.2, slack=1.0)
        return
    with pytest.raises(ContractViolation, match=check):
        await check_backend(backend, ttl=0.2, slack=1.0)


async def test_bad_arguments_are_refused() -> None:
    """A TTL that is not positive, or a negative slack, is a ValueError."""
    async with asynclock.connect("memory://") as coord:
        with pytest.raises(ValueError, match="ttl must be > 0"):
            await check_backend(coord.backend, ttl=0)
        with pytest.raises(ValueError, match="slack >= 0"):
            await check_backend(coord.backend, slack=-1)
