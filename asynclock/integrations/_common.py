"""What the web framework integrations share, whatever the framework: the coordinator for
an app's lifetime, lock names from URL templates, holding a lock around a handler (and
the HTTP answer to a refused or lost lock, as a :class:`Refusal` each framework raises
in its own way), and the leader-only background tasks.

Imports no web framework. :mod:`asynclock.integrations` documents the answers and holds
the public names of leader tasks; this module is private to the integrations.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from .._backoff import Backoff
from .._clock import Clock
from .._coordinator import Coordinator, connect
from .._decorators import leave, template_fields
from .._election import Election, Term, campaign, check_callback, check_election
from .._errors import BackendError, LockLost, LockTimeout
from .._lease import Lease
from .._validate import check_timeout, check_ttl
from . import LEADER_RETRY, LeaderCallback, LeaderState, LeaderTaskStatus, OnError

logger = logging.getLogger("asynclock")

# How long a 423 answer may spend asking who holds the lock, for its Retry-After.
_INSPECT_TIMEOUT = 1.0


# -- the coordinator of an app ------------------------------------------------------------


def needs_extra(module: str, framework: str, extra: str, exc: ImportError) -> ImportError:
    """The error of integration ``module`` imported without its ``framework``: it names
    the extra to install (``pip install 'asynclock[extra]'``)."""
    return ImportError(f"{module} needs {framework}: pip install 'asynclock[{extra}]' ({exc})")


def check_target(target: object, options: Mapping[str, Any]) -> None:
    """Reject a target that is neither a URL, a list of URLs nor a Coordinator now."""
    if isinstance(target, Coordinator):
        if options:
            raise TypeError(
                f"connect options ({', '.join(sorted(options))}) apply to a URL, not to a "
                "Coordinator passed in"
            )
        if target.closed:
            raise ValueError("the Coordinator passed in is closed")
        return
    if isinstance(target, str):
        return
    if isinstance(target, list | tuple) and all(isinstance(url, str) for url in target):
        return
    raise TypeError(
        "expected a URL, a list of Redis URLs (Redlock) or an asynclock.Coordinator, got "
        f"{type(target).__name__}"
    )


@contextlib.asynccontextmanager
async def serving(
    target: str | Sequence[str] | Coordinator,
    options: Mapping[str, Any],
    leaders: LeaderTasks,
    *,
    owner: str,
) -> AsyncIterator[Coordinator]:
    """An app's lifetime: the coordinator (connected from a URL, or the one passed in)
    with ``leaders`` running; on exit the leader tasks are cancelled (each resigns) and
    waited for, then a coordinator connected here is closed (one passed in never is).

    ``owner`` names the caller in the ``RuntimeError`` raised for a coordinator that was
    closed before the app started.
    """
    if isinstance(target, Coordinator):
        coord, owned = target, False
    else:
        coord, owned = connect(target, **options), True
    if coord.closed:
        raise RuntimeError(f"the Coordinator given to {owner} was closed")
    try:
        leaders.start(coord)
        yield coord
    finally:
        try:
            await leaders.stop()
        finally:
            if owned:
                await coord.aclose()


# -- locks around handlers ------------------------------------------------------------------


class Refusal(Exception):
    """The lock could not be held for the request: the status, text and headers to answer."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers or {}


class Template:
    """A lock name template such as ``"invoice:{invoice_id}"``, checked when made."""

    __slots__ = ("fields", "text")

    def __init__(self, template: object) -> None:
        self.fields = template_fields(template, what="path parameters")
        self.text = str(template)

    def lacking(self, available: Iterable[str], where: str) -> str | None:
        """None when the path parameter names ``available`` provide every field of the
        template, else a sentence naming the missing ones and ``where`` they are missing
        (``"the route"``)."""
        names = set(available)
        missing = sorted(self.fields - names)
        if not missing:
            return None
        return (
            f"lock template {self} needs path parameter(s) {', '.join(map(repr, missing))}, "
            f"which {where} does not have (its path parameters: "
            f"{', '.join(map(repr, sorted(names))) or 'none'})"
        )

    def format(self, params: Mapping[str, Any], where: str) -> str:
        """The lock name for a request whose path parameters are ``params``.

        Raises ``RuntimeError`` (a programming error: answered 500) when the route lacks
        a field of the template.
        """
        problem = self.lacking(params, where)
        if problem is not None:
            raise RuntimeError(problem)
        return self.text.format(**params)

    def __repr__(self) -> str:
        return repr(self.text)


def check_lock_options(ttl: object, timeout: object) -> tuple[float, float | None]:
    """Validate ``ttl`` and ``timeout`` when the dependency or decorator is made."""
    return check_ttl(ttl), check_timeout(timeout)


async def _holder_ttl(coord: Coordinator, name: str) -> float | None:
    """Seconds left of the holder's lease (inf if unknown, 0 when free), or None when
    the server does not answer within ``_INSPECT_TIMEOUT``."""
    try:
        async with asyncio.timeout(_INSPECT_TIMEOUT):
            info = await coord.inspect(name)
    except (BackendError, TimeoutError):
        return None
    return 0.0 if info is None else info.expires_in


def _unanswered(exc: LockTimeout) -> bool:
    """The deadline ran out while a request to the server was in flight (the lock raises
    that ``LockTimeout`` from the ``TimeoutError`` of its own bound)."""
    cause = exc.__cause__
    return isinstance(cause, TimeoutError) and not isinstance(cause, LockTimeout)


class HoldTimes:
    """How long one route's requests held their lock: a moving average of the holds that
    ended in this process, the hint of its 423 answers' ``Retry-After``."""

    __slots__ = ("mean",)

    # The weight of the newest hold: recent holds count most, one outlier does not rule.
    _WEIGHT = 0.3

    def __init__(self) -> None:
        self.mean: float | None = None

    def add(self, seconds: float) -> None:
        """Count a hold of ``seconds``."""
        seconds = max(0.0, seconds)
        if self.mean is None:
            self.mean = seconds
        else:
            self.mean += self._WEIGHT * (seconds - self.mean)


def _retry_after(left: float, times: HoldTimes | None) -> int:
    """Whole seconds, at least 1, until the lock is likely free: the route's typical hold,
    capped by the holder's remaining TTL ``left`` (inf when unknown)."""
    hint = left if math.isfinite(left) else None
    typical = times.mean if times is not None else None
    if typical is not None:
        hint = typical if hint is None else min(hint, typical)
    return 1 if hint is None else max(1, math.ceil(hint))


async def _refusal_after_timeout(
    coord: Coordinator, name: str, exc: LockTimeout, times: HoldTimes | None = None
) -> Refusal:
    """423 when another holder kept the lock; 503 when the server did not answer.

    A deadline that ran out with a request in flight is contention only if the server,
    asked who holds the lock, names a holder: a slow server and a deadline that cut a
    refused attempt short look the same from the exception alone.
    """
    left = await _holder_ttl(coord, name)
    if left is None or (left == 0 and _unanswered(exc)):
        return _unavailable(name, exc)
    seconds = _retry_after(left, times)
    return Refusal(
        423,
        f"{name!r} is locked by another request; retry in {seconds}s",
        {"Retry-After": str(seconds)},
    )


def _unavailable(name: str, exc: BaseException) -> Refusal:
    logger.warning("could not lock %r for a request: %s", name, exc)
    return Refusal(503, "the lock service is unavailable; retry later", {"Retry-After": "1"})


@contextlib.asynccontextmanager
async def hold(
    coord: Coordinator,
    name: str,
    *,
    ttl: float,
    timeout: float | None,  # noqa: ASYNC109 - coord.lock()'s timeout, passed through
    times: HoldTimes | None = None,
) -> AsyncIterator[Lease]:
    """Hold ``coord.lock(name)`` around the handler; refusals become :class:`Refusal`.

    ``times`` records how long the lock was held, and hints the ``Retry-After`` of a
    refusal.

    Only this lock's own outcomes are translated: a ``LockTimeout`` or ``LockLost`` that
    the handler raises (from a lock of its own) passes through unchanged.
    """
    try:
        lock = coord.lock(name, ttl=ttl, timeout=timeout)
    except ValueError as exc:  # ttl and timeout were checked already: the name is bad
        raise Refusal(400, f"no valid lock name from this URL: {exc}") from exc
    try:
        lease = await lock.__aenter__()
    except LockTimeout as exc:
        raise await _refusal_after_timeout(coord, name, exc, times) from exc
    except BackendError as exc:
        raise _unavailable(name, exc) from exc
    clock = coord.backend.clock
    began = clock.now()
    try:
        yield lease
    except BaseException as exc:
        if times is not None:
            times.add(clock.now() - began)
        try:
            await leave(lock, exc)
        except LockLost as lost:  # only ever this lease's loss
            raise _lost(name, lost) from lost
        raise
    if times is not None:
        times.add(clock.now() - began)
    try:
        await leave(lock, None)
    except LockLost as lost:
        raise _lost(name, lost) from lost


def _lost(name: str, exc: LockLost) -> Refusal:
    logger.warning("lost the lock %r while handling a request: %s", name, exc)
    return Refusal(503, f"lost the lock {name!r} while handling the request; it was interrupted")


# -- leader-only background tasks ---------------------------------------------------------


class LeaderTasks:
    """The leader tasks of one app: checked when registered, run while the app runs."""

    def __init__(self) -> None:
        self._runners: list[_LeaderRunner] = []
        self._tasks: list[asyncio.Task[None]] = []

    def add(
        self,
        name: object,
        callback: object,
        *,
        ttl: object,
        identity: object,
        on_error: object,
        retry: object,
    ) -> None:
        """Register a leader task; the arguments are validated now, so that a mistake
        fails at registration (``TypeError``/``ValueError``, also for a ``name`` already
        registered)."""
        check_callback(callback)
        checked_name, seconds, _ = check_election(name, ttl, identity)
        assert identity is None or isinstance(identity, str)  # checked just above
        if on_error not in ("restart", "stop"):
            raise ValueError(f"on_error must be 'restart' or 'stop', got {on_error!r}")
        if retry is not None and not isinstance(retry, Backoff):
            raise TypeError(f"retry must be an asynclock.Backoff, got {type(retry).__name__}")
        if checked_name in self.names():
            raise ValueError(f"a leader task {checked_name!r} is already registered")
        spec = _LeaderSpec(
            checked_name,
            cast(LeaderCallback, callback),
            seconds,
            identity,
            on_error,
            retry or LEADER_RETRY,
        )
        self._runners.append(_LeaderRunner(spec))

    def names(self) -> list[str]:
        """The registered elections, in registration order."""
        return [runner.spec.name for runner in self._runners]

    def status(self) -> dict[str, LeaderTaskStatus]:
        """Each leader task's state by election name."""
        return {runner.spec.name: runner.status() for runner in self._runners}

    def start(self, coord: Coordinator) -> None:
        """One task per leader task, campaigning on ``coord`` until :meth:`stop` (or
        stopped by a bug)."""
        self._tasks = [runner.start(coord) for runner in self._runners]

    async def stop(self) -> None:
        """Cancel the leader tasks (each resigns its term) and wait until they are done."""
        tasks, self._tasks = self._tasks, []
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


@dataclass(frozen=True, slots=True)
class _LeaderSpec:
    """A registered leader-only task (checked by :meth:`LeaderTasks.add`):
    ``coord.election(name, ...)`` campaigned by a :class:`_LeaderRunner`."""

    name: str
    callback: LeaderCallback
    ttl: float
    identity: str | None
    on_error: OnError
    retry: Backoff


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _LeaderRunner:
    """Runs one leader task while the app runs and keeps its state."""

    def __init__(self, spec: _LeaderSpec) -> None:
        self.spec = spec
        self._clock: Clock | None = None
        self._state: LeaderState = "stopped"
        self._identity: str | None = None
        self._term: int | None = None
        self._terms = 0
        self._failures = 0
        self._error: str | None = None
        self._retry_at: float | None = None
        self._began: float | None = None
        self._detail = "not started"

    def start(self, coord: Coordinator) -> asyncio.Task[None]:
        """Start campaigning (a task owned by the caller, who cancels it to stop)."""
        spec = self.spec
        election = coord.election(spec.name, ttl=spec.ttl, identity=spec.identity)
        self._clock = coord.backend.clock
        self._identity = election.identity
        self._terms = self._failures = 0
        self._error = None
        self.campaigning()
        task = asyncio.get_running_loop().create_task(
            self._main(election, coord.backend.clock), name=f"asynclock-leader:{spec.name}"
        )
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The task is done: it says "stopped" even if it was cancelled before its first
        step (an app whose startup failed right after starting it), when _main's own
        handlers never ran."""
        if self._state != "stopped":
            self._stop("stopped: the app shut down" if task.cancelled() else "stopped")

    async def _main(self, election: Election, clock: Clock) -> None:
        spec = self.spec
        try:
            await campaign(
                election,
                spec.callback,
                clock=clock,
                pauses=spec.retry,
                restart_bugs=spec.on_error == "restart",
                watch=self,
            )
        except asyncio.CancelledError:
            self._stop("stopped: the app shut down")
            raise
        except Exception as exc:  # a bug under on_error="stop", or a closed coordinator
            self._error = _describe(exc)
            self._failures += 1
            self._stop(f"stopped: {self._error}; it is not restarted")
            logger.exception(
                "leader task %r stopped: %s; it is not restarted", spec.name, self._error
            )

    def _stop(self, detail: str) -> None:
        self._state, self._term, self._retry_at, self._detail = "stopped", None, None, detail

    # CampaignWatch
    def campaigning(self) -> None:
        self._state, self._term, self._retry_at = "campaigning", None, None
        self._detail = "campaigning: waiting to lead"

    def leading(self, term: Term) -> None:
        assert self._clock is not None
        self._state, self._term, self._began = "leading", term.fence, self._clock.now()
        self._terms += 1
        self._detail = f"leading term {term.fence}"

    def pausing(self, ended: BaseException | None, delay: float) -> None:
        assert self._clock is not None
        now = self._clock.now()
        if self._began is not None and now - self._began >= self.spec.ttl:
            self._failures, self._error = 0, None  # a healthy term: start the count again
        self._state, self._term, self._retry_at, self._began = (
            "backing_off",
            None,
            now + delay,
            None,
        )
        if ended is None:
            what = "the callback returned"
        else:
            self._error = _describe(ended)
            self._failures += 1
            what = f"the term ended: {self._error}"
        self._detail = f"{what}; campaigning again in {delay:.2f}s"

    def status(self) -> LeaderTaskStatus:
        """A snapshot of the task's state."""
        retry_in = None
        if self._retry_at is not None and self._clock is not None:
            retry_in = max(0.0, self._retry_at - self._clock.now())
        return LeaderTaskStatus(
            name=self.spec.name,
            state=self._state,
            identity=self._identity,
            term=self._term,
            terms=self._terms,
            failures=self._failures,
            error=self._error,
            retry_in=retry_in,
            detail=self._detail,
        )


def jsonable(value: object) -> object:
    """``json.dumps(default=)`` for job arguments beyond JSON's own (what Celery's JSON
    serializer brings, what arq's pickle carries), tagged with their type: a stable text
    form for the lock name's digest. ``TypeError`` for anything else."""
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return {"$" + type(value).__name__: value.isoformat()}
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return {"$" + type(value).__name__: str(value)}
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, set | frozenset):
        items = [json.dumps(item, sort_keys=True, default=jsonable) for item in value]
        return {"$set": sorted(items)}
    raise TypeError(f"an argument of type {type(value).__name__} has no stable text form")
