"""The backend contract kit: what every :class:`~asynclock.backends.base.Backend` must do.

A backend implementer runs :func:`check_backend` on an instance connected to a real
server (for example from a pytest test)::

    async def test_my_backend_keeps_the_contract() -> None:
        backend = MyBackend(...)
        try:
            await check_backend(backend)
        finally:
            await backend.aclose()

Each check uses names of its own (``prefix`` plus a random part) and raises
:class:`ContractViolation` naming the check and what happened. The checks speak the
backend's own interface, the one the engine uses, not ``Coordinator``:

- a grant has a fence, and the holder shows in ``inspect()``;
- a second holder is refused while the first holds; a refusal may say when to retry,
  never later than the holder's TTL;
- release by the holder frees the name; release or extend by a non-holder is refused and
  touches nothing; a release sent again (a retry) never frees a later holder's lock;
- fences strictly increase across grants of a name;
- ``extend()`` resets the expiry; a lock left to expire is free within its TTL (plus
  ``slack``), and its old holder can neither extend nor release it;
- ``owns()`` answers for exclusive holders;
- a release wakes a waiter registered with ``waiter()`` before it;
- a refused attempt's place in a waiter queue is given back (``give_back`` after
  :attr:`~asynclock.backends.Interrupted.ANSWERED`), and so is a grant whose acquire was
  interrupted (after :attr:`~asynclock.backends.Interrupted.CANCELLED`);
- the kinds the backend declares in :attr:`~asynclock.backends.Backend.kinds`: readers
  share and exclude a writer (:attr:`~asynclock.backends.Kind.SHARED`), at most ``limit``
  permits (:attr:`~asynclock.backends.Kind.PERMIT`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable

from ..backends.base import Backend, Claim, Interrupted, Kind

__all__ = ("ContractViolation", "check_backend")


class ContractViolation(AssertionError):
    """A backend broke its contract: the message names the check and what happened."""


def _claim(name: str, kind: Kind = Kind.EXCLUSIVE, *, limit: int = 0) -> Claim:
    return Claim(name, secrets.token_hex(16), "contract-kit", kind, limit=limit)


class _Kit:
    def __init__(self, backend: Backend, prefix: str, ttl: float, slack: float) -> None:
        self.backend = backend
        self.prefix = prefix
        self.ttl = ttl
        self.slack = slack
        self.check = ""

    def name(self) -> str:
        return f"{self.prefix}{secrets.token_hex(4)}"

    def fail(self, what: str) -> ContractViolation:
        return ContractViolation(f"{type(self.backend).__name__}: {self.check}: {what}")

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            raise self.fail(what)

    async def grant(self, claim: Claim, ttl: float | None = None) -> int:
        attempt = await self.backend.try_acquire(claim, self.ttl if ttl is None else ttl)
        self.expect(attempt.fence is not None, f"{claim.name!r} is free, but was refused")
        assert attempt.fence is not None
        self.expect(attempt.fence > 0, f"a grant's fence must be positive, got {attempt.fence}")
        return attempt.fence

    async def refused(self, claim: Claim) -> None:
        attempt = await self.backend.try_acquire(claim, self.ttl)
        self.expect(
            attempt.fence is None,
            f"{claim.name!r} was granted to a second holder (fence {attempt.fence})",
        )
        if attempt.retry_after is not None:
            self.expect(
                0 <= attempt.retry_after <= self.ttl + self.slack,
                f"a refusal said retry after {attempt.retry_after}s, beyond the holder's "
                f"TTL of {self.ttl}s",
            )
        await self.backend.give_back(claim, Interrupted.ANSWERED)

    async def run(self) -> None:
        checks: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("grant and inspect", self.grant_and_inspect),
            ("fences increase", self.fences_increase),
            ("one holder at a time", self.one_holder),
            ("release by the holder only", self.release_by_holder_only),
            ("extend resets the expiry", self.extend_resets),
            ("an expired lock is free and stays lost to its holder", self.expiry),
            ("owns() answers for the holder", self.owns),
            ("a release wakes a waiter", self.wakes_a_waiter),
            ("an interrupted acquire is given back", self.gives_back),
        ]
        if Kind.SHARED in self.backend.kinds:
            checks.append(("readers share, a writer is excluded", self.readers))
        if Kind.PERMIT in self.backend.kinds:
            checks.append(("at most limit permits", self.permits))
        for self.check, check in checks:
            await check()

    async def grant_and_inspect(self) -> None:
        claim = _claim(self.name())
        self.expect(await self.backend.inspect(claim.name) is None, "a fresh name is held")
        fence = await self.grant(claim)
        info = await self.backend.inspect(claim.name)
        self.expect(info is not None, "inspect() does not show the holder")
        assert info is not None
        self.expect(info.fence == fence, f"inspect() shows fence {info.fence}, granted {fence}")
        self.expect(info.owner == "contract-kit", f"inspect() shows owner {info.owner!r}")
        self.expect(
            0 < info.expires_in <= self.ttl + self.slack,
            f"inspect() shows {info.expires_in}s left of a {self.ttl}s TTL",
        )
        self.expect(await self.backend.release(claim), "the holder's release was refused")

    async def one_holder(self) -> None:
        name = self.name()
        first, second = _claim(name), _claim(name)
        await self.grant(first)
        await self.refused(second)
        self.expect(await self.backend.release(first), "the holder's release was refused")
        await self.grant(second)
        self.expect(await self.backend.release(second), "the holder's release was refused")

    async def release_by_holder_only(self) -> None:
        name = self.name()
        holder, other = _claim(name), _claim(name)
        fence = await self.grant(holder)
        self.expect(not await self.backend.release(other), "a non-holder's release succeeded")
        self.expect(not await self.backend.extend(other, self.ttl), "a non-holder extended")
        info = await self.backend.inspect(name)
        self.expect(
            info is not None and info.fence == fence,
            "a non-holder's release or extend touched the holder's lock",
        )
        self.expect(await self.backend.release(holder), "the holder's release was refused")
        # Sent again (a retry of a release whose reply was lost): either answer will do,
        # but it must not take the name from whoever holds it next.
        await self.backend.release(holder)
        self.expect(await self.backend.inspect(name) is None, "a released name is still held")
        newer = _claim(name)
        later = await self.grant(newer)
        await self.backend.release(holder)
        info = await self.backend.inspect(name)
        self.expect(
            info is not None and info.fence == later,
            "a release by an earlier holder freed the next holder's lock",
        )
        self.expect(await self.backend.release(newer), "the holder's release was refused")

    async def fences_increase(self) -> None:
        name = self.name()
        last = 0
        for _ in range(5):
            claim = _claim(name)
            fence = await self.grant(claim)
            self.expect(fence > last, f"fence {fence} after {last}: fences must increase")
            last = fence
            self.expect(await self.backend.release(claim), "the holder's release was refused")

    async def extend_resets(self) -> None:
        claim = _claim(self.name())
        await self.grant(claim, ttl=self.ttl)
        self.expect(await self.backend.extend(claim, self.ttl * 3), "the holder's extend failed")
        info = await self.backend.inspect(claim.name)
        self.expect(
            info is not None and info.expires_in > self.ttl,
            f"after extend({self.ttl * 3}) inspect() shows "
            f"{None if info is None else info.expires_in}s left",
        )
        self.expect(await self.backend.release(claim), "the holder's release was refused")

    async def expiry(self) -> None:
        name = self.name()
        holder = _claim(name)
        fence = await self.grant(holder, ttl=self.ttl)
        deadline = time.monotonic() + self.ttl + self.slack
        while await self.backend.inspect(name) is not None:
            self.expect(
                time.monotonic() < deadline,
                f"still held {self.slack}s after its {self.ttl}s TTL ran out",
            )
            await asyncio.sleep(self.ttl / 20)
        self.expect(not await self.backend.extend(holder, self.ttl), "an expired lock extended")
        newer = _claim(name)
        later = await self.grant(newer)
        self.expect(later > fence, f"fence {later} after an expired {fence}")
        self.expect(
            not await self.backend.release(holder), "the expired holder released a new grant"
        )
        self.expect(await self.backend.release(newer), "the holder's release was refused")

    async def owns(self) -> None:
        claim = _claim(self.name())
        fence = await self.grant(claim)
        self.expect(await self.backend.owns(claim, fence), "owns() is False for the holder")
        self.expect(not await self.backend.owns(claim, fence + 1), "owns() takes any fence")
        self.expect(await self.backend.release(claim), "the holder's release was refused")
        self.expect(not await self.backend.owns(claim, fence), "owns() is True after release")

    async def wakes_a_waiter(self) -> None:
        name = self.name()
        holder, waiter = _claim(name), _claim(name)
        # Long enough that only a wake-up, not the holder's expiry, can end the wait.
        ttl = 3 * (self.ttl + self.slack)
        await self.grant(holder, ttl=ttl)
        bound = self.ttl + self.slack
        if self.backend.native_wait:
            # It waits in the server's own queue: the release must grant it there.
            waiting = asyncio.ensure_future(self.backend.try_acquire(waiter, ttl, wait=ttl))
            await asyncio.sleep(min(self.ttl / 5, 0.1))  # let the request reach the queue
            self.expect(not waiting.done(), f"{name!r} was granted to a second holder")
            self.expect(await self.backend.release(holder), "the holder's release was refused")
            try:
                attempt = await asyncio.wait_for(waiting, bound)
            except TimeoutError:
                raise self.fail(f"a release reached no waiter within {bound}s") from None
            self.expect(attempt.fence is not None, "the waiter was refused after the release")
        else:
            async with self.backend.waiter(name) as slot:
                slot.tag = waiter.value  # as the engine does: a release naming it wakes it
                # A caller that waits (wait != 0) joins the name's waiter queue, if any.
                attempt = await self.backend.try_acquire(waiter, self.ttl, wait=bound)
                self.expect(attempt.fence is None, f"{name!r} was granted to a second holder")
                released = self.backend.release(holder)
                self.expect(await released, "the holder's release was refused")
                clock = self.backend.clock
                woken = await slot.wait(clock, clock.now() + bound)
                self.expect(woken, f"a release woke no waiter within {bound}s")
            await self.grant(waiter)
        self.expect(await self.backend.release(waiter), "the holder's release was refused")

    async def gives_back(self) -> None:
        name = self.name()
        # A fair claim's place in line keeps later claims out, where the backend has one.
        kind = Kind.FAIR if Kind.FAIR in self.backend.kinds else Kind.EXCLUSIVE
        holder, stopped = _claim(name, kind), _claim(name, kind)
        await self.grant(holder)
        # A caller that would wait (wait != 0) joins the name's waiter queue, if any; one
        # that waits in the server's own queue gives up there at once.
        wait = 0.0 if self.backend.native_wait else self.ttl
        attempt = await self.backend.try_acquire(stopped, self.ttl, wait=wait)
        self.expect(attempt.fence is None, f"{name!r} was granted to a second holder")
        answer = await self.backend.give_back(stopped, Interrupted.ANSWERED)
        self.expect(not answer.released, "a refused attempt's give-back released something")
        self.expect(await self.backend.release(holder), "the holder's release was refused")
        later = _claim(name, kind)
        await self.grant(later)  # the stopped acquire's place no longer keeps it out
        answer = await self.backend.give_back(later, Interrupted.CANCELLED)
        self.expect(answer.released, "the give-back of a granted, interrupted acquire was refused")
        self.expect(answer.late >= 0, f"a give-back said it may land {answer.late}s late")
        self.expect(await self.backend.inspect(name) is None, "a given-back grant is still held")

    async def readers(self) -> None:
        name = self.name()
        readers = [_claim(name, Kind.SHARED) for _ in range(3)]
        for reader in readers:
            await self.grant(reader)
        await self.refused(_claim(name))
        for reader in readers:
            self.expect(await self.backend.release(reader), "a reader's release was refused")
        writer = _claim(name)
        await self.grant(writer)
        await self.refused(_claim(name, Kind.SHARED))
        self.expect(await self.backend.release(writer), "the writer's release was refused")

    async def permits(self) -> None:
        name = self.name()
        held = [_claim(name, Kind.PERMIT, limit=2) for _ in range(2)]
        fences = [await self.grant(claim) for claim in held]
        self.expect(len(set(fences)) == 2, f"two permits share a fence: {fences}")
        await self.refused(_claim(name, Kind.PERMIT, limit=2))
        self.expect(await self.backend.release(held[0]), "a permit's release was refused")
        third = _claim(name, Kind.PERMIT, limit=2)
        await self.grant(third)
        for claim in (held[1], third):
            self.expect(await self.backend.release(claim), "a permit's release was refused")


async def check_backend(
    backend: Backend, *, prefix: str = "contract-", ttl: float = 0.5, slack: float = 2.0
) -> None:
    """Check that ``backend`` keeps the backend contract (see the module's docstring).

    ``ttl`` is the TTL of the leases the checks take (the expiry check waits for one to
    run out), ``slack`` how much longer than that a server may take to let it go (a
    loaded machine, expiry sampling). Names start with ``prefix``. Takes a few seconds;
    raises :class:`ContractViolation` at the first check that fails, and whatever the
    backend raises (``BackendError`` if its server cannot be reached).
    """
    if ttl <= 0 or slack < 0:
        raise ValueError(f"ttl must be > 0 and slack >= 0, got ttl={ttl!r}, slack={slack!r}")
    await _Kit(backend, prefix, ttl, slack).run()
