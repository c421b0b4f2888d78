"""Redlock over several independent Redis/Valkey nodes.

Every operation fans out to all nodes at once (``asyncio.gather``), each node bounded by
``node_timeout``, and needs a majority:

- acquire: the single-node acquire script on every node; with a majority granted within
  the validity time (``ttl - elapsed - drift``), the lease's fence is the largest fence
  counter among them, written back to each of them (``RAISE_FENCE``, only while still
  holding it there) and confirmed by a majority before the lease is granted. Any two
  majorities share a node, and that node's counter is at least the earlier lease's fence,
  so the next lease's fence is larger: fences are monotonic across majorities. Without a
  majority, whatever was taken is released on every node at once, and the caller retries.
  Every round writes a value of its own (a fresh token, :meth:`Claim.reissue`): a release
  of an earlier round still on its way to a node (sent on a connection the client gave up
  on) names that round's value, so it can never delete a later round's grant.
- extend: compare-and-extend everywhere; a majority must confirm.
- release: compare-and-delete everywhere, including nodes that timed out earlier.

The scripts are the single-node ones (:mod:`.redis.scripts`), plus the fence write-back.
Each node is a :class:`~.redis.RedisBackend`, used through its public members only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from .._cancel import undo_on_interrupt
from .._clock import Clock
from .._errors import BackendError, QuorumError
from .._tasks import TaskSet
from .._types import ExcType, ExcValue, Traceback
from .._validate import check_number
from .._wakeup import Mailbox, WakeHub, WakeSlot
from .base import Attempt, Backend, Claim, GiveBack, Interrupted, LockInfo, owner_of
from .redis import Call, Keys, RedisBackend, client_from_url
from .redis.pipe import pack

__all__ = ("RedlockBackend",)

T = TypeVar("T")
N = TypeVar("N", int, float)

_BACKEND_OPTIONS = ("prefix", "fence_retention", "clock", "drift_factor", "drift_base")
# Rounds of an acquire before too many failed or late nodes make it a QuorumError.
_QUORUM_ROUNDS = 3
# How far ahead of our clock the proposed fence floor is (µs): more than the request
# takes to reach the nodes, so that their own clocks fall below it.
_FLOOR_LEAD_US = 5_000


class RedlockBackend(Backend):
    """Locks on a majority of independent Redis/Valkey nodes.

    ``clients`` are ``redis.asyncio.Redis`` clients the application owns (not closed by
    ``aclose()``), one per node: at least 3; an odd number is best (5 tolerates two
    nodes down, 4 tolerates only one). ``node_timeout`` (seconds, default 0.05) bounds
    each node's answer: a frozen or dead node costs at most that much per step. Raises
    ``ValueError`` for fewer than 3 clients or a bad timeout.
    """

    def __init__(
        self,
        clients: Sequence[Redis],
        *,
        node_timeout: float = 0.05,
        prefix: str = "asynclock",
        fence_retention: float = 3600.0,
        clock: Clock | None = None,
        drift_factor: float = 0.01,
        drift_base: float = 0.002,
    ) -> None:
        super().__init__(clock=clock, drift_factor=drift_factor, drift_base=drift_base)
        given: object = clients  # checked at run time, whatever the annotation says
        if not isinstance(given, list | tuple):
            raise TypeError("clients must be a list of redis.asyncio.Redis clients")
        if len(clients) < 3:
            raise ValueError(
                f"Redlock needs at least 3 independent nodes (5 is usual), got {len(clients)}"
            )
        self.node_timeout = check_number("node_timeout", node_timeout, positive=True)
        self._nodes = [
            RedisBackend(
                client,
                prefix=prefix,
                fence_retention=fence_retention,
                clock=self.clock,
                drift_factor=drift_factor,
                drift_base=drift_base,
            )
            for client in clients
        ]
        self.quorum = len(self._nodes) // 2 + 1
        # Every count of nodes against the majority is made by this one object.
        self._majority = _Majority(len(self._nodes), self.quorum)
        # One hub for every node's wake-ups: a release counts once a majority announced it.
        self._hub = WakeHub(quorum=self.quorum)
        for node in self._nodes:
            node.share_hub(self._hub)
        self._owns_clients = False
        # Node operations still running after their fan-out was decided.
        # Per-node requests (stragglers finish here after the outcome was decided) and
        # releases sent to nodes that did not answer.
        self._tasks = TaskSet("Redlock")
        # Each node's server run_id, learnt when the nodes are first reached: one server
        # listed under several addresses would count as several votes (see _check_nodes).
        self._run_ids: list[str | None] = [None] * len(self._nodes)
        self._learning: asyncio.Task[None] | None = None
        self._next_look = 0.0
        self._refusal: ValueError | None = None

    @classmethod
    def from_urls(
        cls,
        urls: Sequence[str],
        *,
        node_timeout: float = 0.05,
        max_connections: int = 64,
        **options: Any,
    ) -> RedlockBackend:
        """A backend on clients of its own, one per URL (closed by ``aclose()``)."""
        own = {k: options.pop(k) for k in _BACKEND_OPTIONS if k in options}
        clients: list[Redis] = []
        for url in urls:
            client = client_from_url(url, max_connections=max_connections, **options)
            if not isinstance(client, Redis):
                raise TypeError("Redlock nodes are independent Redis servers, not a Cluster")
            clients.append(client)
        _check_addresses(clients)
        backend = cls(clients, node_timeout=node_timeout, **own)
        backend._owns_clients = True
        return backend

    @property
    def nodes(self) -> list[RedisBackend]:
        """The per-node backends, in the order the clients were given."""
        return list(self._nodes)

    # -- fan-out ---------------------------------------------------------------------

    async def _each(
        self,
        op: Callable[[RedisBackend], Awaitable[T]],
        nodes: Sequence[RedisBackend] | None = None,
        *,
        wanted: Callable[[object], bool] | None = None,
        refused: Callable[[object], bool] | None = None,
    ) -> list[T | BackendError | TimeoutError | None]:
        """``op`` on every node at once, all bounded by one ``node_timeout`` deadline.

        A node that fails or does not answer in time yields its error. With ``wanted``,
        the call returns as soon as the outcome is decided: a majority of results are
        wanted, or so many are refused (see :func:`_refuses`) that a majority no longer
        can be. Nodes still working
        then (a frozen node, typically) yield None and finish in the background, within
        the same deadline: one slow node does not slow everyone down.
        """
        targets = self._nodes if nodes is None else nodes
        expired = _Deadline()

        async def one(node: RedisBackend) -> T | BackendError | TimeoutError:
            try:
                return await op(node)
            except BackendError as exc:
                return exc
            except asyncio.CancelledError:
                if expired.passed:
                    return TimeoutError(f"no answer within {self.node_timeout:g}s")
                raise

        # Quiet: a node's failure is its reply (an error value), not a crash to log.
        tasks = [
            self._tasks.spawn(one(node), name="asynclock-redlock-node", quiet=True)
            for node in targets
        ]
        # One timer for the whole fan-out, not one asyncio.timeout per node.
        expired.handle = asyncio.get_running_loop().call_later(
            self.node_timeout, expired.expire, tasks
        )
        pending = set(tasks)
        yes = no = 0
        with undo_on_interrupt(expired.abandon, tasks):
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if wanted is None:
                    continue
                for task in done:
                    reply = task.result()
                    if wanted(reply):
                        yes += 1
                    elif _refuses(reply, wanted, refused):
                        no += 1
                if self._majority.decided(yes, no):
                    break
        if not pending:  # else the stragglers finish in self._tasks, within the deadline
            expired.cancel()
        return [task.result() if task.done() else None for task in tasks]

    async def _script(
        self,
        call: Call,
        nodes: Sequence[RedisBackend] | None = None,
        *,
        wanted: Callable[[object], bool] | None = None,
        refused: Callable[[object], bool] | None = None,
    ) -> list[Any]:
        """Run a script call on every node at once: raw replies (an exception for a node
        that failed or was late, None for one still working when the outcome was decided).

        With every node on a connected pipelined connection, one packed command is written
        to each and their replies are tallied as they arrive, without a task per node;
        otherwise (TLS, a node connecting) it goes through :meth:`_each`.
        """
        targets = self._nodes if nodes is None else nodes
        senders = [node.sender() for node in targets]
        if not targets or any(send is None for send in senders):
            return await self._each(
                lambda node: node.run(call), targets, wanted=wanted, refused=refused
            )
        script, numkeys, args = call
        packed = pack(("EVALSHA", script.sha, numkeys, *args))
        tally = _Tally(len(targets), self._majority, wanted, refused)
        for i, send in enumerate(senders):
            assert send is not None
            send(packed, functools.partial(tally.settle, i))
        timer = asyncio.get_running_loop().call_later(self.node_timeout, tally.expire)
        try:
            await tally.decided
        finally:
            timer.cancel()
        results = list(tally.results)
        # A node that does not know the script (restarted, SCRIPT FLUSH) loads it and
        # answers again, on its own.
        unknown = [i for i, reply in enumerate(results) if _is_noscript(reply)]
        if unknown:
            again = await self._each(lambda node: node.run(call), [targets[i] for i in unknown])
            for i, reply in zip(unknown, again, strict=True):
                results[i] = reply
        return results

    def _round(self, claim: Claim) -> _Rounds:
        rounds = claim.handle
        if rounds is None:
            rounds = claim.handle = _Rounds(self._nodes[0].keys(claim.name))
        return rounds  # type: ignore[no-any-return]

    def _keys(self, claim: Claim) -> Keys:
        return self._round(claim).keys

    def _no_quorum(self, what: str, failed: int) -> QuorumError:
        return QuorumError(
            f"{self.describe()}: {what}: {failed} of {len(self._nodes)} nodes failed or did "
            f"not answer within {self.node_timeout:g}s; a majority is {self.quorum}"
        )

    # -- the Backend interface -------------------------------------------------------

    async def _check_nodes(self) -> None:
        """Refuse to lock over nodes that are one server (the same ``run_id``).

        The first acquire waits for every node's ``INFO server`` (bounded by
        ``node_timeout``); nodes that did not answer are asked again in the background, at
        most once a second, and a duplicate found then fails the next acquire. Raises
        ``ValueError`` naming the nodes that are one server.
        """
        if self._refusal is not None:
            raise self._refusal
        if None not in self._run_ids:
            return
        learning = self._learning
        first = learning is None
        if learning is None or (learning.done() and self.clock.now() >= self._next_look):
            learning = self._learning = self._tasks.spawn(
                self._learn_run_ids(), name="asynclock-redlock-run-ids", quiet=True
            )
        if first:
            # Shielded: the first acquire's cancel must not stop the others' check.
            await asyncio.shield(learning)
            if self._refusal is not None:
                raise self._refusal

    async def _learn_run_ids(self) -> None:
        unknown = [i for i, run_id in enumerate(self._run_ids) if run_id is None]
        replies = await self._each(lambda node: node.run_id(), [self._nodes[i] for i in unknown])
        for i, reply in zip(unknown, replies, strict=True):
            if isinstance(reply, str):
                self._run_ids[i] = reply
        self._next_look = self.clock.now() + 1.0
        seen: dict[str, list[str]] = {}
        for node, run_id in zip(self._nodes, self._run_ids, strict=True):
            if run_id is not None:
                seen.setdefault(run_id, []).append(node.describe())
        shared = [where for where in seen.values() if len(where) > 1]
        if shared:
            self._refusal = ValueError(
                "Redlock needs independent servers, but these nodes are one server (the "
                f"same run_id): {'; '.join(' = '.join(where) for where in shared)}"
            )

    async def try_acquire(self, claim: Claim, ttl: float, *, wait: float | None = 0.0) -> Attempt:
        await self._check_nodes()
        # Nodes that fail or answer late are retried a couple of times before QuorumError:
        # under a burst, a Python process can itself be the reason a node "answers" late,
        # and a real outage still fails within a few node timeouts.
        for round_ in range(_QUORUM_ROUNDS):
            attempt, failed = await self._acquire_once(claim, ttl)
            if self._majority.tolerates(failed):
                return attempt
            if round_ < _QUORUM_ROUNDS - 1:
                await asyncio.sleep(random.random() * self.node_timeout)  # noqa: S311
        raise self._no_quorum("acquire", failed)

    async def _acquire_once(self, claim: Claim, ttl: float) -> tuple[Attempt, int]:
        """One Redlock round: the attempt, and how many nodes failed or were late."""
        rounds = self._round(claim)
        if rounds.sent:
            # A value of its own for every round: the last round's give-back may still be
            # on its way to a node (on a connection the client gave up on, behind a
            # proxy) and would delete a grant made with the same value.
            claim.reissue()
        rounds.sent = True
        keys = rounds.keys
        value = claim.value
        start = self.clock.now()
        # Every node is offered the same fence floor (our clock, a little ahead): when each
        # granting node lands on it, a majority already stores the lease's fence and the
        # write-back round trip is not needed. Correctness never depends on this clock.
        floor = time.time_ns() // 1000 + _FLOOR_LEAD_US
        first = self._nodes[0]
        replies = await self._script(first.calls.acquire(keys, value, ttl, floor), wanted=_granted)
        granted = [
            (node, reply)
            for node, reply in zip(self._nodes, replies, strict=True)
            if isinstance(reply, int) and reply > 0
        ]
        failed = sum(isinstance(reply, Exception) for reply in replies)
        if self._majority.reached(len(granted)):
            fence = max(reply for _, reply in granted)
            behind = [node for node, reply in granted if reply < fence]
            stored = len(granted) - len(behind)  # nodes whose counter already is the fence
            if behind and not self._majority.reached(stored):
                confirms = await self._script(
                    first.calls.raise_fence(keys, value, fence, ttl), behind, wanted=_one
                )
                stored += sum(_one(confirm) for confirm in confirms)
                failed += sum(isinstance(confirm, Exception) for confirm in confirms)
            left = ttl - (self.clock.now() - start) - self.drift(ttl)
            if self._majority.reached(stored) and left > 0:
                return Attempt(fence), 0
        # No majority: give back at once what we took, on every node (one that timed out
        # may have taken it all the same), so that our retry does not block itself. Nodes
        # that answered are waited for; the others finish in the background.
        release = first.calls.release(keys, value)
        answered = [
            node
            for node, reply in zip(self._nodes, replies, strict=True)
            if reply is not None and not isinstance(reply, Exception)
        ]
        silent = [node for node in self._nodes if node not in answered]
        if silent:
            self._tasks.spawn_unless_closed(
                self._give_back(release, silent, start + ttl),
                name="asynclock-redlock-background",
            )
        await self._script(release, answered)
        return Attempt(None, self._free_in(replies, len(granted))), failed

    async def _give_back(self, release: Call, nodes: Sequence[RedisBackend], until: float) -> None:
        """Release a failed round's value on ``nodes`` that did not answer, again at
        growing intervals until each answers or the round's TTL has passed (``until``, on
        this clock): a partition that held the round's replies may have let it take a
        majority, and the next rounds, with values of their own, cannot release it."""
        pending = list(nodes)
        delay = self.node_timeout
        while True:
            replies = await self._each(lambda node: node.run(release), pending)
            pending = [
                node
                for node, reply in zip(pending, replies, strict=True)
                if reply is None or isinstance(reply, Exception)
            ]
            if not pending or self.clock.now() + delay >= until:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _free_in(self, replies: Sequence[object], free: int) -> float | None:
        """When enough holders' leases run out for a majority, if every holder said."""
        held = sorted(
            -reply / 1000 if reply < 0 else math.inf
            for reply in replies
            if isinstance(reply, int) and reply <= 0
        )
        needed = self._majority.missing(free)
        if needed <= 0 or needed > len(held) or math.isinf(held[needed - 1]):
            return None
        return held[needed - 1]

    async def extend(self, claim: Claim, ttl: float) -> bool:
        keys = self._keys(claim)
        call = self._nodes[0].calls.extend(keys, claim.value, ttl)
        results = await self._script(call, wanted=_one, refused=_zero)
        verdict = self._verdict(results)
        if verdict is None:
            raise self._no_quorum("extend", sum(isinstance(r, Exception) for r in results))
        if verdict:
            _straggled(claim, ttl, results)
        return verdict

    def _verdict(self, results: Sequence[object]) -> bool | None:
        """True if a majority confirmed, False if so many refused that none can, else None."""
        return self._majority.verdict(
            sum(_one(result) for result in results), sum(_zero(result) for result in results)
        )

    async def extend_many(self, items: Sequence[tuple[Claim, float]]) -> list[bool | None]:
        batch = [(self._keys(claim), claim.value, ttl) for claim, ttl in items]
        per_node = await self._each(lambda node: node.extend_many_keys(batch))
        verdicts: list[bool | None] = []
        for i, (claim, ttl) in enumerate(items):
            replies = [results[i] if isinstance(results, list) else None for results in per_node]
            verdict = self._verdict(replies)
            if verdict:
                _straggled(claim, ttl, replies)
            verdicts.append(verdict)
        return verdicts

    async def release(self, claim: Claim) -> bool:
        keys = self._keys(claim)
        results = await self._script(
            self._nodes[0].calls.release(keys, claim.value), wanted=_one, refused=_zero
        )
        verdict = self._verdict(results)
        if verdict is None:
            raise self._no_quorum("release", sum(isinstance(r, Exception) for r in results))
        return verdict

    async def inspect(self, name: str) -> LockInfo | None:
        keys = self._nodes[0].keys(name)
        results = await self._each(lambda node: node.inspect_keys(keys))
        failed = sum(isinstance(r, Exception) for r in results)
        found = [r for r in results if isinstance(r, tuple)]
        holders = Counter(value for value, _, _ in found)
        if holders:
            value, count = holders.most_common(1)[0]
            if self._majority.reached(count):
                mine = [r for r in found if r[0] == value]
                # Held while a majority holds it: until the quorum-th longest TTL ends.
                expires_in = self._majority.agreed([left for _, left, _ in mine])
                # The holder's fence is on a majority (the grant waits for that); a node
                # that granted late may still show an older, smaller counter.
                fence = self._majority.agreed([counter for _, _, counter in mine])
                return LockInfo(name, owner_of(value), expires_in, fence)
        if not self._majority.tolerates(failed):
            raise self._no_quorum("inspect", failed)
        return None

    def waiter(self, name: str) -> AbstractAsyncContextManager[WakeSlot]:
        return _RedlockWaiter(self._hub, self._each, self._tasks, self._nodes[0].channel(name))

    async def publish(self, topic: str, message: str) -> None:
        # Every node that answers in time carries it; listeners hear it once per node
        # (elections order announcements by term, so repeats are harmless).
        await self._each(lambda node: node.publish(topic, message))

    def listen(self, topic: str) -> AbstractAsyncContextManager[Mailbox]:
        return self._listen(topic)

    @asynccontextmanager
    async def _listen(self, topic: str) -> AsyncIterator[Mailbox]:
        mailbox = Mailbox()
        channel = self._nodes[0].topic_channel(topic)
        for node in self._nodes:
            node.subscriber.deliver(channel, mailbox)
        subscribed: list[RedisBackend] = []
        try:
            results = await self._each(lambda node: node.subscriber.subscribe(channel))
            subscribed = [
                node
                for node, result in zip(self._nodes, results, strict=True)
                if not isinstance(result, Exception)
            ]
            yield mailbox
        finally:
            for node in self._nodes:
                node.subscriber.undeliver(channel, mailbox)
            with contextlib.suppress(BackendError):
                await self._each(
                    lambda node: node.subscriber.unsubscribe(channel, confirm=False), subscribed
                )

    async def aclose(self) -> None:
        await self._tasks.close(2 * self.node_timeout)  # each is bounded by node_timeout
        for node in self._nodes:
            await node.aclose()
        if self._owns_clients:
            for node in self._nodes:
                await node.client.aclose()

    async def give_back(self, claim: Claim, interrupted: Interrupted) -> GiveBack:
        if interrupted is Interrupted.ANSWERED:
            return GiveBack(False)  # no waiter queue of its own
        released = await self.release(claim)
        return GiveBack(released, max(node.late_landing(interrupted) for node in self._nodes))

    def describe(self) -> str:
        where = ", ".join(node.address for node in self._nodes)
        return f"RedlockBackend {len(self._nodes)} nodes ({where})"


class _Majority:
    """``quorum`` of ``nodes``, and what a count of their replies decides: the one place
    where Redlock counts (acquire, fence write-back, extend, release, inspect, and
    every fan-out that returns once the outcome is decided)."""

    __slots__ = ("_spare", "quorum")

    def __init__(self, nodes: int, quorum: int) -> None:
        self.quorum = quorum
        # How many nodes may fail, refuse or be late with a majority still possible.
        self._spare = nodes - quorum

    def reached(self, yes: int) -> bool:
        """``yes`` nodes are a majority."""
        return yes >= self.quorum

    def tolerates(self, failed: int) -> bool:
        """A majority is still possible with ``failed`` nodes out."""
        return failed <= self._spare

    def decided(self, yes: int, no: int) -> bool:
        """Whether ``yes`` nodes for and ``no`` against settle the outcome."""
        return yes >= self.quorum or no > self._spare

    def verdict(self, yes: int, no: int) -> bool | None:
        """True with a majority for, False once one can no longer be reached, else None."""
        if yes >= self.quorum:
            return True
        if no > self._spare:
            return False
        return None

    def missing(self, yes: int) -> int:
        """How many more nodes ``yes`` needs to be a majority (<= 0: none)."""
        return self.quorum - yes

    def agreed(self, values: Sequence[N]) -> N:
        """The largest value that a majority of ``values`` (one per node, at least a
        majority of them) reach: their ``quorum``-th largest."""
        return sorted(values, reverse=True)[self.quorum - 1]


class _Each(Protocol):
    """The backend's fan-out, as a waiter uses it: ``op`` on every node (or on ``nodes``)
    at once, each bounded by the node timeout; a node's error or lateness is its result."""

    def __call__(
        self, op: Callable[[RedisBackend], Awaitable[T]], nodes: Sequence[RedisBackend] | None = ...
    ) -> Awaitable[list[T | BackendError | TimeoutError | None]]: ...


class _Rounds:
    """A Redlock claim's own state (``claim.handle``): the name's keys, and whether the
    claim's current value already went out in a round (the next round reissues it)."""

    __slots__ = ("keys", "sent")

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.sent = False


class _Deadline:
    """The end of a fan-out's time: cancels whatever node operation is still running."""

    __slots__ = ("handle", "passed")

    def __init__(self) -> None:
        self.passed = False
        self.handle: asyncio.TimerHandle | None = None

    def expire(self, tasks: Sequence[asyncio.Future[Any]]) -> None:
        self.passed = True
        for task in tasks:
            task.cancel()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def abandon(self, tasks: Sequence[asyncio.Future[Any]]) -> None:
        """The fan-out was interrupted: no timer, and no node operation, outlives it."""
        self.cancel()
        for task in tasks:
            task.cancel()


def _straggled(claim: Claim, ttl: float, replies: Sequence[object]) -> None:
    """A majority confirmed an extend to ``ttl``: if a node has not answered (still
    working, failed, or late), its copy may still land after a later, longer extend and
    cut that node's expiry to ``ttl`` from then; the lease counts no confirmation beyond
    ``ttl`` from now on (:attr:`Claim.floor`)."""
    if any(reply is None or isinstance(reply, BaseException) for reply in replies):
        claim.floor = min(claim.floor, ttl)


class _Tally:
    """Replies of one fan-out as they arrive, and whether the outcome is decided yet."""

    __slots__ = (
        "_majority",
        "_no",
        "_refused",
        "_settled",
        "_wanted",
        "_yes",
        "decided",
        "results",
    )

    def __init__(
        self,
        n: int,
        majority: _Majority,
        wanted: Callable[[object], bool] | None,
        refused: Callable[[object], bool] | None,
    ) -> None:
        self.results: list[Any] = [None] * n
        self._settled = [False] * n
        self._majority = majority
        self._wanted = wanted
        self._refused = refused
        self._yes = self._no = 0
        self.decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def settle(self, i: int, reply: Any) -> None:
        if self._settled[i]:
            return
        self._settled[i] = True
        self.results[i] = reply
        if self._wanted is not None:
            if self._wanted(reply):
                self._yes += 1
            elif _refuses(reply, self._wanted, self._refused):
                self._no += 1
            if self._majority.decided(self._yes, self._no):
                self._decide()
        if all(self._settled):
            self._decide()

    def expire(self) -> None:
        for i, settled in enumerate(self._settled):
            if not settled:
                self.settle(i, TimeoutError("no answer within the node timeout"))
        self._decide()

    def _decide(self) -> None:
        if not self.decided.done():
            self.decided.set_result(None)


def _check_addresses(clients: Sequence[Redis]) -> None:
    """ValueError if two clients connect to one address: one server, several votes."""
    seen: Counter[str] = Counter()
    for client in clients:
        options = client.connection_pool.connection_kwargs
        path = options.get("path")
        host = str(options.get("host", "localhost")).lower()
        seen[f"unix://{path}" if path else f"{host}:{options.get('port', 6379)}"] += 1
    repeated = [f"{address} ({count} times)" for address, count in seen.items() if count > 1]
    if repeated:
        raise ValueError(
            "Redlock needs independent servers, but a node is listed more than once: "
            + ", ".join(repeated)
        )


def _refuses(
    reply: object, wanted: Callable[[object], bool], refused: Callable[[object], bool] | None
) -> bool:
    """Whether a reply counts against the majority: ``refused`` when given (a node that
    failed or was late then counts for neither side), else anything not wanted except a
    node that has yet to load the script and is asked again."""
    if refused is not None:
        return refused(reply)
    return not wanted(reply) and not _is_noscript(reply)


def _one(reply: object) -> bool:
    return isinstance(reply, int) and reply == 1


def _zero(reply: object) -> bool:
    return isinstance(reply, int) and reply == 0


def _is_noscript(reply: object) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT")


def _granted(reply: object) -> bool:
    return isinstance(reply, int) and reply > 0


class _RedlockWaiter:
    """A slot in ``hub`` for ``channel``, then a subscription to it on every node that
    answers within the node timeout (``each``, the backend's fan-out).

    Nodes that are down do not hold the waiter up: a majority of them announcing a
    release is what wakes it, and the backoff covers the rest. Unsubscribes that must
    not hold the caller up go on in ``tasks``.
    """

    __slots__ = ("_channel", "_each", "_hub", "_slot", "_subscribed", "_tasks")

    def __init__(self, hub: WakeHub, each: _Each, tasks: TaskSet, channel: str) -> None:
        self._hub = hub
        self._each = each
        self._tasks = tasks
        self._channel = channel
        self._slot: WakeSlot | None = None
        self._subscribed: list[RedisBackend] = []

    async def __aenter__(self) -> WakeSlot:
        slot = self._slot = self._hub.register(self._channel)
        channel = self._channel
        subscribed: list[RedisBackend] = []

        async def subscribe(node: RedisBackend) -> None:
            await node.subscriber.subscribe(channel)
            subscribed.append(node)

        with undo_on_interrupt(self._abandon, slot, subscribed):
            await self._each(subscribe)
        self._subscribed = subscribed
        return slot

    def _abandon(self, slot: WakeSlot, subscribed: list[RedisBackend]) -> None:
        """Entering was interrupted: unregister ``slot``, and drop the subscriptions of
        the nodes that confirmed (in the background)."""
        self._hub.unregister(slot)
        # Cancelled while a slow node had yet to confirm: the nodes that did keep a
        # reference each (the channel would stay subscribed for good). Drop them.
        if subscribed:
            self._tasks.spawn_unless_closed(
                self._unsubscribe(subscribed, confirm=False),
                name=f"asynclock-redlock-unsubscribe:{self._channel}",
            )

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        assert self._slot is not None
        self._hub.unregister(self._slot)
        subscribed, self._subscribed = self._subscribed, []
        if exc_type is None:
            await self._unsubscribe(subscribed, confirm=False)
            return
        # Giving up (timed out, cancelled): the unsubscribes go on in the background, so
        # that silent nodes do not hold the caller's LockTimeout or cancel back.
        self._tasks.spawn_unless_closed(
            self._unsubscribe(subscribed, confirm=True),
            name=f"asynclock-redlock-unsubscribe:{self._channel}",
        )
        await asyncio.sleep(0)

    async def _unsubscribe(self, nodes: list[RedisBackend], *, confirm: bool) -> None:
        channel = self._channel
        with contextlib.suppress(BackendError):
            await self._each(
                lambda node: node.subscriber.unsubscribe(channel, confirm=confirm), nodes
            )
