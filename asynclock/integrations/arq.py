"""arq integration: a job that runs once at a time per its arguments, under a lease renewed
while it runs.

::

    from typing import Any

    from arq.connections import RedisSettings

    from asynclock.integrations import arq as locks

    URL = "redis://127.0.0.1:6379/0"


    @locks.singleton("report:{day}", ttl=60, on_held="skip")
    async def rebuild_report(ctx: dict[str, Any], day: str) -> int:
        lease = ctx[locks.LEASE]
        await write_report(day, fence=lease.fence)  # one run per day at a time
        return lease.fence


    async def startup(ctx: dict[str, Any]) -> None:
        await locks.startup(ctx, URL)  # the lock server (may be arq's own Redis)


    async def shutdown(ctx: dict[str, Any]) -> None:
        await locks.shutdown(ctx)


    class WorkerSettings:
        functions = [rebuild_report]
        on_startup = startup
        on_shutdown = shutdown
        redis_settings = RedisSettings.from_dsn(URL)

A run of a decorated job first takes the lock named from its arguments. While it runs,
the lease is renewed (every third of ``ttl``) by the worker's event loop; when the run
ends, however it ends (returned, raised, timed out, aborted, cancelled by a worker
shutdown), the lock is released. A worker killed mid-run (``kill -9``, an OOM kill, a
lost machine) stops renewing, and the lock is free again within ``ttl``: the TTL is
short because it is renewed. A lease *lost* while the job runs (the server refused a
renewal, or it could not be renewed in time) cancels the job's body and the job fails
with :class:`~asynclock.LockLost`. When the lock server cannot be reached, the job fails
with :class:`~asynclock.BackendError` (it never runs unprotected).

:func:`singleton` takes:

- ``template`` (default None): the lock name, formatted with the run's arguments bound to
  the job's parameters with their defaults (``"report:{day}"``); runs whose names are
  equal exclude each other. It is used as it is, so a name can be shared with locks
  taken elsewhere (``coord.lock("report:2026-12-04")``). It may not name the job's first
  parameter, arq's ``ctx``. None: ``arq:<the function's __qualname__>:`` and a digest of
  every other argument (JSON, sorted keys, SHA-256): same arguments, same lock, whether
  given by position or by keyword.
- ``ttl`` (default 60): seconds of the lease; the time a killed worker blocks its job at
  most.
- ``on_held`` (default ``"skip"``): what a run does when another run holds the lock:
  ``"skip"`` returns None without running (logged at INFO on the ``asynclock`` logger;
  arq records the job as complete with a None result); ``"retry"`` raises
  ``arq.worker.Retry(defer=retry_defer)``: arq runs the job again later, counting the
  try against the job's ``max_tries`` (arq's default 5; ``arq.func(job, max_tries=...)``),
  past which arq fails it (``max N retries exceeded``; a worker with
  ``retry_jobs=False`` fails it at once); ``"wait"`` waits for the lock
  (up to ``timeout``, then the job fails with :class:`~asynclock.LockTimeout`) while
  taking one of the worker's ``max_jobs`` slots.
- ``timeout`` (default None): how long a run waits for the lock before ``on_held``
  applies. None: 0 for ``"skip"`` and ``"retry"`` (try once), no limit for ``"wait"``
  (arq's ``job_timeout`` still applies: 300 s by default).
- ``retry_defer`` (default 5): seconds before the retry under ``on_held="retry"``.

Bad options raise ``TypeError`` or ``ValueError`` when decorating (at import).

The coordinator of a run is ``ctx[COORDINATOR]``, put there once per worker process by
``await startup(ctx, url)`` from the worker's ``on_startup`` (an arq worker is one
process, one event loop); ``await shutdown(ctx)`` from ``on_shutdown`` closes it. Inside
the job, ``ctx[LEASE]`` is the run's :class:`asynclock.Lease`: pass ``lease.fence`` to
what the job writes. (arq gives each job a ``ctx`` of its own; a direct call, as in a
test, passes a dict of its own too: ``{**worker_ctx, "job_id": ...}``.)

The lock is taken when the job *runs*, not when it is enqueued (arq's own ``_job_id``
de-duplicates enqueues of one id; this excludes runs of different ids): twenty jobs
enqueued at once with the same arguments while one run holds the lock run once (the
others are skipped, retried or wait); a job that starts after that run ended runs again.

Needs arq 0.26 or later (``pip install 'asynclock[arq]'``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, get_args

from . import _common as common

try:
    from arq.worker import Retry  # type: ignore[import-not-found,unused-ignore]
except ImportError as exc:
    raise common.needs_extra(__name__, "arq", "arq", exc) from exc

from .._coordinator import Coordinator, connect
from .._decorators import namer, run_held, template_fields
from .._errors import LockTimeout
from .._validate import check_number, check_timeout, check_ttl

__all__ = ("COORDINATOR", "LEASE", "OnHeld", "shutdown", "singleton", "startup")

logger = logging.getLogger("asynclock")

P = ParamSpec("P")
R = TypeVar("R")

#: The ``ctx`` key of the worker's :class:`asynclock.Coordinator` (set by :func:`startup`).
COORDINATOR = "asynclock"
#: The ``ctx`` key of the job's :class:`asynclock.Lease`: set when the lock is taken, and
#: left there when the run ends (arq's ``on_job_end``/``after_job_end`` see the same ctx).
LEASE = "asynclock_lease"

#: What a run does when another run holds its lock: ``"skip"`` (return None),
#: ``"retry"`` (``arq.worker.Retry``) or ``"wait"`` (wait for the lock).
OnHeld = Literal["skip", "retry", "wait"]

_ON_HELD: tuple[str, ...] = get_args(OnHeld)

# Coordinators startup() connected (closed by shutdown(); one passed in never is).
_made: weakref.WeakSet[Coordinator] = weakref.WeakSet()


async def startup(
    ctx: dict[Any, Any], target: str | Sequence[str] | Coordinator, /, **options: Any
) -> Coordinator:
    """Put the worker's coordinator in ``ctx[COORDINATOR]``; call it from ``on_startup``.

    ``target``: a URL or a list of Redis URLs (Redlock), connected with ``options`` (those
    of :func:`asynclock.connect`), or a :class:`~asynclock.Coordinator` of the
    application's (never closed by :func:`shutdown`). Returns the coordinator. Raises
    ``TypeError``/``ValueError`` for a bad target or options.
    """
    common.check_target(target, options)
    if isinstance(target, Coordinator):
        coord = target
    else:
        coord = connect(target, **options)
        _made.add(coord)
    ctx[COORDINATOR] = coord
    return coord


async def shutdown(ctx: dict[Any, Any]) -> None:
    """Take the coordinator out of ``ctx`` and close it if :func:`startup` connected it
    (its leases released, its connections closed); call it from ``on_shutdown``."""
    coord = ctx.pop(COORDINATOR, None)
    if isinstance(coord, Coordinator) and coord in _made:
        _made.discard(coord)
        await coord.aclose()


def singleton(
    template: str | None = None,
    *,
    ttl: float = 60.0,
    on_held: OnHeld = "skip",
    timeout: float | None = None,
    retry_defer: float = 5.0,
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R | None]]]:
    """Decorate an arq job (``async def job(ctx, ...)``) to run once at a time per lock
    name, under a lease renewed while it runs; see :mod:`asynclock.integrations.arq` for
    the arguments and what happens when the lock is held.

    Use it with parentheses (``@singleton()``), under arq's own ``func()``/``cron()``.
    """
    if callable(template):
        raise TypeError("use @singleton() with parentheses (or @singleton('name:{arg}'))")
    fields = None if template is None else template_fields(template, what="job's parameters")
    ttl = check_ttl(ttl)
    if on_held not in _ON_HELD:
        raise ValueError(
            f"on_held must be one of {', '.join(map(repr, _ON_HELD))}, got {on_held!r}"
        )
    wait_at_most = check_timeout(timeout)
    if wait_at_most is None and on_held != "wait":
        wait_at_most = 0.0
    defer = check_number("retry_defer", retry_defer, positive=True)

    def decorate(
        fn: Callable[P, Coroutine[Any, Any, R]],
    ) -> Callable[P, Coroutine[Any, Any, R | None]]:
        label = getattr(fn, "__qualname__", repr(fn))
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{label!r} must be an async def function (an arq job)")
        ctx_name, name_for = _namer(fn, label, template, fields)

        @functools.wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> R | None:
            # arq passes ctx first; a direct call may name it.
            state, coord = _context(args[0] if args else kwargs.get(ctx_name), label)
            lock = coord.lock(name_for(args, kwargs), ttl=ttl, timeout=wait_at_most)
            try:
                lease = await lock.__aenter__()
            except LockTimeout as held:
                job = f"{state.get('job_id', '-')}:{label}"
                if on_held == "skip":
                    logger.info(
                        "arq job %s skipped: lock %r is held by another run", job, lock.name
                    )
                    return None
                if on_held == "retry":
                    logger.info(
                        "arq job %s retries in %g s: lock %r is held by another run",
                        job,
                        defer,
                        lock.name,
                    )
                    raise Retry(defer=defer) from held
                raise
            before = state.get(LEASE)
            state[LEASE] = lease
            try:
                return await run_held(lock, fn, args, kwargs)
            finally:
                if before is not None:  # a job run from another's body, with its ctx
                    state[LEASE] = before

        return run

    return decorate


def _context(ctx: object, label: str) -> tuple[dict[Any, Any], Coordinator]:
    """A run's ``ctx`` and the coordinator :func:`startup` put in it; a ``RuntimeError``
    that says how to put it there when it is missing."""
    if not isinstance(ctx, dict):
        raise TypeError(
            f"{label}: ctx must be arq's job context (a dict), got {type(ctx).__name__}"
        )
    coord = ctx.get(COORDINATOR)
    if coord is None:
        raise RuntimeError(
            f"{label}: no asynclock coordinator in ctx[{COORDINATOR!r}]: call "
            "`await asynclock.integrations.arq.startup(ctx, url)` in the worker's on_startup"
        )
    if not isinstance(coord, Coordinator):
        raise TypeError(
            f"{label}: ctx[{COORDINATOR!r}] must be an asynclock.Coordinator (the async one), "
            f"got {type(coord).__name__}"
        )
    return ctx, coord


def _namer(
    fn: Callable[..., Any], label: str, template: str | None, fields: frozenset[str] | None
) -> tuple[str, Callable[[tuple[Any, ...], dict[str, Any]], str]]:
    """The name of ``fn``'s ``ctx`` parameter, and the function from a call's arguments
    (``ctx`` first) to its lock name; checks ``fn`` takes ``ctx`` first and that
    ``template`` names its other parameters only."""
    signature = inspect.signature(fn)
    parameters = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not parameters or parameters[0].kind not in positional:
        raise TypeError(f"{label}() must take arq's ctx as its first parameter")
    ctx_name = parameters[0].name
    if template is not None:
        assert fields is not None
        if ctx_name in fields:
            raise ValueError(
                f"template {template!r} names {ctx_name!r}, arq's job context: name the "
                "job's own parameters"
            )
        return ctx_name, namer(template, fn, fields)
    prefix = f"arq:{label}:"

    def name_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments[ctx_name]
        try:
            text = json.dumps(
                arguments, sort_keys=True, separators=(",", ":"), default=common.jsonable
            )
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{label}: cannot name its lock from these arguments ({exc}); give "
                "@singleton('...{parameter}...') a template of the arguments that matter"
            ) from None
        return prefix + hashlib.sha256(text.encode()).hexdigest()[:32]

    return ctx_name, name_for
