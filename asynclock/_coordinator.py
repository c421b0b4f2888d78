"""``connect()`` and :class:`Coordinator`: the entry point that builds locks, elections
and decorators, and owns the engine they run on (``asynclock._engine``: the backend, the
watchdog, the background clean-ups)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Collection, Coroutine, Sequence
from typing import Any, ParamSpec, Self, TypeVar
from urllib.parse import urlsplit

from . import _decorators
from ._backoff import Backoff
from ._election import Election, check_election, default_identity
from ._engine import Engine
from ._lease import Lease
from ._lock import Lock, ReadWriteLock
from ._stats import CoordinatorStats
from ._types import ExcType, ExcValue, Traceback
from ._validate import check_name, check_timeout, check_ttl
from .backends.base import Backend, Kind, LockInfo
from .backends.memory import MemoryBackend

__all__ = ("Coordinator", "connect")

P = ParamSpec("P")
R = TypeVar("R")

_DEFAULT_RETRY = Backoff()
# Permits of one semaphore: each is a member of a set the acquire scans.
_MAX_PERMITS = 10_000
_REDIS_SCHEMES = ("redis", "rediss", "unix")
_SCHEMES = (
    "memory",
    *_REDIS_SCHEMES,
    "redis+sentinel",
    "redis+cluster",
    "postgresql",
    "postgres",
)


class Coordinator:
    """Locks on one backend, with one watchdog for all of their leases.

    ``Coordinator(backend)`` wraps a backend built from clients the application owns
    (they are not closed by :meth:`aclose`); :func:`connect` builds both from a URL.
    ``identity`` names this coordinator in ``inspect()`` results and is the identity of
    its elections' candidates unless :meth:`election` is given one (default
    ``host:pid:random``). ``telemetry``: OpenTelemetry metrics and spans when
    ``opentelemetry-api`` is installed (None, the default), never (False). Use it as an
    async context manager, or call :meth:`aclose`.
    """

    def __init__(
        self, backend: Backend, *, identity: str | None = None, telemetry: bool | None = None
    ) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(
                f"backend must be an asynclock.backends.Backend, got {type(backend).__name__}"
            )
        if identity is not None:
            check_name(identity, "identity")
        self._backend = backend
        # What its locks, leases and elections run on (and share): see asynclock._engine.
        self._engine: Engine[Lease] = Engine(backend, identity or default_identity(), telemetry)
        # The backend tells us when a hold certainly ended on the server (a PostgreSQL
        # session that died): that lease is lost now, not at its next renewal.
        backend.on_hold_lost(self._engine.hold_lost)

    @property
    def identity(self) -> str:
        """This coordinator's name in ``inspect()`` results, and its candidates' identity."""
        return self._engine.identity

    @identity.setter
    def identity(self, identity: str) -> None:
        self._engine.identity = identity

    @property
    def backend(self) -> Backend:
        """The backend this coordinator's locks live on."""
        return self._backend

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` was called."""
        return self._engine.closed

    def lock(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        renew: bool = True,
        cancel_on_lost: bool = True,
        retry: Backoff | None = None,
        shared: bool = False,
        fair: bool = False,
    ) -> Lock:
        """A lock on ``name``; use ``async with coord.lock(name) as lease:``.

        - ``ttl``: lease length in seconds (finite, > 0); every lease has one.
        - ``timeout``: ``None`` waits until acquired, ``0`` tries once, ``> 0`` waits at
          most that long; then :class:`~asynclock.LockTimeout`.
        - ``renew``: extend the lease every ``ttl/3`` while it is held.
        - ``cancel_on_lost``: cancel the body when the lease is lost; ``async with`` then
          raises :class:`~asynclock.LockLost`. With False the body runs on, ``lease.lost``
          turns true and leaving the block raises ``LockLost``.
        - ``retry``: the :class:`Backoff` between attempts when no wake-up comes.
        - ``shared``: a shared (reader) lease, where the backend supports it; see
          :meth:`rwlock`.
        - ``fair``: first come, first served: waiters get the lock in the order they
          first tried, and a release wakes the first in line only. A waiter that dies
          keeps its place until its backoff's maximum plus a second has passed.

        Raises ``TypeError``/``ValueError`` at once for bad arguments.
        """
        common = self._check(name, ttl, timeout, retry, renew, cancel_on_lost, shared, fair)
        if shared:
            self._require(Kind.SHARED, "shared=True")
        if fair and shared:
            raise ValueError("fair=True is for exclusive locks, not shared=True")
        if fair:
            self._require(Kind.FAIR, "fair=True")
        return Lock(self._engine, name, **common, shared=shared, fair=fair)

    def semaphore(
        self,
        name: str,
        limit: int,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        renew: bool = True,
        cancel_on_lost: bool = True,
        retry: Backoff | None = None,
    ) -> Lock:
        """A counting semaphore: at most ``limit`` holders of ``name`` at once.

        ``async with coord.semaphore("api-quota", 5) as permit:`` — each permit is a
        :class:`Lease` like a lock's: its own TTL, renewal, fence, loss and cancellation;
        a crashed holder's permit expires with its TTL. Every holder of one semaphore
        must use the same ``limit``. The other arguments are :meth:`lock`'s. Semaphores
        live apart from locks of the same name.
        """
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int, got {type(limit).__name__}")
        if not 1 <= limit <= _MAX_PERMITS:
            raise ValueError(f"limit must be from 1 to {_MAX_PERMITS}, got {limit}")
        common = self._check(name, ttl, timeout, retry, renew, cancel_on_lost)
        self._require(Kind.PERMIT, "semaphores")
        return Lock(self._engine, name, **common, shared=False, limit=limit)

    def rwlock(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        renew: bool = True,
        cancel_on_lost: bool = True,
        retry: Backoff | None = None,
    ) -> ReadWriteLock:
        """A read-write lock: ``async with rw.read():`` shares ``name`` with other
        readers, ``async with rw.write():`` excludes everyone.

        Writers are preferred: once a writer waits, new readers wait behind it, so a
        steady stream of readers cannot starve it; it gets in as soon as the readers
        already inside have left (or their leases ended). The arguments are
        :meth:`lock`'s, for both sides.
        """
        common = self._check(name, ttl, timeout, retry, renew, cancel_on_lost)
        self._require(Kind.SHARED, "read-write locks")
        engine = self._engine
        read, write = (Lock(engine, name, **common, shared=shared) for shared in (True, False))
        return ReadWriteLock(name, read, write)

    def _check(
        self,
        name: object,
        ttl: object,
        timeout: object,
        retry: Backoff | None,
        *flags: bool,
    ) -> dict[str, Any]:
        """Validate what every lock-like object takes; the Lock arguments they share."""
        self._backend.check_name(check_name(name))
        names = ("renew", "cancel_on_lost", "shared", "fair")
        for flag, value in zip(names, flags, strict=False):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
        if retry is None:
            retry = _DEFAULT_RETRY
        elif not isinstance(retry, Backoff):
            raise TypeError(f"retry must be an asynclock.Backoff, got {type(retry).__name__}")
        return {
            "ttl": self._engine.check_validity(check_ttl(ttl)),
            "timeout": check_timeout(timeout),
            "renew": flags[0],
            "cancel_on_lost": flags[1],
            "retry": retry,
        }

    def _require(self, kind: Kind, what: str) -> None:
        if kind not in self._backend.kinds:
            raise ValueError(
                f"{what} {'is' if what.endswith('True') else 'are'} not supported by "
                f"{type(self._backend).__name__} (supported: memory, Redis, PostgreSQL)"
            )

    def election(
        self,
        name: str,
        *,
        ttl: float = 10.0,
        identity: str | None = None,
        retry: Backoff | None = None,
    ) -> Election:
        """Leader election ``name`` among every candidate that uses it.

        ``ttl``: a term lasts that long without renewal (a crashed leader is replaced
        within about ``ttl``); ``identity``: what :meth:`Election.leader` reports for this
        candidate (default: this coordinator's :attr:`identity`); ``retry``: the backoff
        between attempts.
        """
        name, seconds, who = check_election(name, ttl, identity)
        who = self.identity if who is None else who
        self._engine.check_validity(seconds)
        if retry is not None and not isinstance(retry, Backoff):
            raise TypeError(f"retry must be an asynclock.Backoff, got {type(retry).__name__}")
        return Election(
            self._engine, name, ttl=seconds, identity=who, retry=retry or _DEFAULT_RETRY
        )

    def singleton(
        self, template: str, *, ttl: float = 60.0
    ) -> Callable[
        [Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R | None]]
    ]:
        """Decorate an ``async def`` to run only if no other call with the same lock name
        is running (anywhere): otherwise the call is skipped and returns None.

        The name comes from ``template`` formatted with the call's arguments, defaults
        included (``"report:{day}"``); a field that is not a parameter of the function
        is a ``ValueError`` when decorating.
        """
        return _decorators.singleton(self, template, ttl=ttl)

    def locked(
        self, template: str, *, ttl: float = 30.0, timeout: float | None = None
    ) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
        """Decorate an ``async def`` to run under the lock named by ``template`` (formatted
        with the call's arguments), waiting up to ``timeout`` for it (then
        :class:`~asynclock.LockTimeout`)."""
        return _decorators.locked(self, template, ttl=ttl, timeout=timeout)

    async def inspect(self, name: str) -> LockInfo | None:
        """Who holds ``name`` now (owner identity, seconds left, fence), or None if free."""
        return await self._engine.inspect(name)

    async def is_locked(self, name: str) -> bool:
        """True if someone holds ``name`` now."""
        return await self.inspect(name) is not None

    def stats(self) -> CoordinatorStats:
        """Counters since this coordinator began, gauges now, latency summaries."""
        return self._engine.recorder.snapshot(self._engine.count_held())

    @property
    def held(self) -> list[Lease]:
        """The leases this coordinator holds now."""
        return self._engine.held()

    # -- lifecycle -------------------------------------------------------------------

    async def aclose(self) -> None:
        """Release every lease still held, stop the watchdog, and close what
        :func:`connect` opened. Idempotent.

        The bodies of other tasks' leases are cancelled as on loss (their blocks raise
        :class:`~asynclock.LockLost`); a lease whose own body calls ``aclose()`` is
        released instead, and its block ends without error. The close runs to its end
        even if the call is cancelled (the ``CancelledError`` is raised once it has), and
        a later ``aclose()`` waits for it. It is
        bounded: about 5 s for acquires and releases still in flight, then the backend's
        own close (up to its request or socket timeout more, over a server that stopped
        answering). Raises ``RuntimeError`` when called from another event loop than the
        coordinator's.
        """
        await self._engine.aclose()

    async def __aenter__(self) -> Self:
        self._engine.check_open()
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: Traceback) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._engine.closed else f"held={self._engine.count_held()}"
        return f"<Coordinator {self._backend.describe()} identity={self.identity!r} {state}>"


def _scheme(url: str) -> str:
    return urlsplit(url).scheme.lower() if "://" in url else ""


def _keywords(*functions: Callable[..., Any]) -> set[str]:
    """The keyword parameters of ``functions``."""
    names: set[str] = set()
    for function in functions:
        names.update(
            p.name
            for p in inspect.signature(function).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )
    return names


def _check_options(
    what: str,
    options: dict[str, Any],
    ours: Collection[str],
    theirs: Collection[str] = (),
    driver: str = "",
) -> None:
    """TypeError naming each of ``options`` that is neither ``ours`` (asynclock's) nor
    ``theirs`` (``driver``'s), with the closest accepted name and every accepted one:
    otherwise a typo reaches the driver and fails there, in its words."""
    accepted = {"identity", *ours, *theirs}
    unknown = sorted(set(options) - accepted)
    if not unknown:
        return
    guesses = [
        f"{name!r} (did you mean {close[0]!r}?)"
        if (close := difflib.get_close_matches(name, accepted, n=1))
        else repr(name)
        for name in unknown
    ]
    listed = f"asynclock's: {', '.join(sorted({'identity', *ours}))}"
    if theirs:
        listed += f"; {driver}'s: {', '.join(sorted(set(theirs) - set(ours)))}"
    raise TypeError(
        f"unknown option{'s' if len(unknown) > 1 else ''} for {what}: {', '.join(guesses)}"
        f" (accepted: {listed})"
    )


def _need_driver(module: str, extra: str, what: str) -> None:
    """``ModuleNotFoundError`` saying which extra to install if ``module`` is missing."""
    import importlib.util  # noqa: PLC0415 - only when connecting: keeps `import asynclock` lean

    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"{what} needs the {module} package, which is not installed: "
            f"pip install 'asynclock[{extra}]'",
            name=module,
        )


def _connect_redlock(urls: list[object], options: dict[str, Any]) -> Coordinator:
    for url in urls:
        if not isinstance(url, str):
            raise TypeError(f"Redlock targets must be URL strings, got {type(url).__name__}")
        if _scheme(url) not in _REDIS_SCHEMES:
            raise ValueError(
                f"Redlock nodes must be redis://, rediss:// or unix:// URLs, got scheme "
                f"{_scheme(url)!r}"
            )
    _need_driver("redis", "redis", "Redlock")
    from .backends.redis import backend_options  # noqa: PLC0415 - as for one node
    from .backends.redlock import RedlockBackend  # noqa: PLC0415 - redis-py loads on first use

    ours = {"node_timeout", *_keywords(RedlockBackend.__init__, RedlockBackend.from_urls)}
    ours -= {"self", "cls", "clients", "urls"}
    theirs: set[str] = set()
    for url in urls:
        theirs |= backend_options(str(url))[1]
    _check_options("Redlock", options, ours, theirs, "redis-py")
    identity = options.pop("identity", None)
    backend = RedlockBackend.from_urls([str(url) for url in urls], **options)
    return Coordinator(backend, identity=identity)


def connect(target: str | Sequence[str], **options: Any) -> Coordinator:
    """A :class:`Coordinator` for a URL. No I/O happens until the first use.

    ``memory://`` and ``memory://NAME`` (in-process; the same NAME shares one lock table),
    ``redis://``, ``rediss://`` and ``unix://`` (one Redis/Valkey node),
    ``redis+sentinel://host:port,host:port/service`` (the master Sentinel names),
    ``redis+cluster://host:port`` (Redis Cluster),
    ``postgresql://`` and ``postgres://`` (PostgreSQL advisory locks). ``options``:
    ``identity``, ``drift_factor``, ``drift_base``; for Redis ``prefix``,
    ``fence_retention``, ``sync_replicas`` and ``sync_timeout`` (not on Cluster),
    ``max_connections`` (default 64) and redis-py pool options; for
    PostgreSQL ``namespace``, ``schema``, ``fence_sequence``, ``max_connections`` (default
    32) and ``asyncpg.create_pool`` options. A list of Redis URLs (3 or more) is Redlock
    over those independent nodes, with ``node_timeout`` (default 0.05 s) and the Redis
    options. The coordinator closes what it opened in
    :meth:`Coordinator.aclose`.

    Raises ``TypeError`` for a target that is neither a URL nor a list of them, or for
    unknown options; ``ValueError`` for an unsupported scheme or fewer than 3 Redlock
    nodes; ``ModuleNotFoundError`` naming the extra to install when the URL's driver is
    missing (``asynclock[redis]`` brings redis-py, ``asynclock[postgres]`` asyncpg).
    """
    if not isinstance(target, str):
        given: object = target  # checked at run time, whatever the annotation says
        if isinstance(given, list | tuple):
            return _connect_redlock(list(given), options)
        raise TypeError(
            f"target must be a URL string or a list of Redis URLs, got {type(target).__name__}"
        )
    scheme = _scheme(target)
    if scheme not in _SCHEMES:
        shown = f"scheme {scheme!r}" if scheme else "a URL without a scheme"
        raise ValueError(
            f"unsupported target: {shown} (accepted: {', '.join(s + '://' for s in _SCHEMES)}, "
            "or a list of redis:// URLs for Redlock)"
        )
    identity = options.pop("identity", None)
    backend: Backend
    if scheme == "memory":
        _check_options("memory://", options, ("drift_factor", "drift_base"))
        backend = MemoryBackend.shared(target.split("://", 1)[1], **options)
    elif scheme in ("postgresql", "postgres"):
        # Each driver loads when a URL first needs it: Redis users never import asyncpg,
        # PostgreSQL users never import redis-py.
        _need_driver("asyncpg", "postgres", f"{scheme}://")
        import asyncpg  # noqa: PLC0415 - see above

        from .backends.postgres import PostgresBackend  # noqa: PLC0415 - see above

        ours = _keywords(PostgresBackend.__init__, PostgresBackend.from_dsn) - {"self", "pool"}
        # What from_dsn() sets itself is not the caller's to pass.
        theirs = _keywords(asyncpg.create_pool, asyncpg.connect)
        theirs -= {"dsn", "min_size", "max_size", "reset", "loop", "connect_kwargs"}
        _check_options(f"{scheme}://", options, ours - {"dsn"}, theirs, "asyncpg")
        backend = PostgresBackend.from_dsn(target, **options)
    else:
        _need_driver("redis", "redis", f"{scheme}://")
        from .backends.redis import RedisBackend, backend_options  # noqa: PLC0415 - see above

        _check_options(f"{scheme}://", options, *backend_options(target), "redis-py")
        backend = RedisBackend.from_url(target, **options)
    return Coordinator(backend, identity=identity)
