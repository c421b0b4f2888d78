"""FastAPI integration: a coordinator for the app's lifetime, per-request locks named from
the path, and leader-only background tasks.

::

    from typing import Annotated

    from fastapi import FastAPI

    from asynclock import Lease
    from asynclock.integrations.fastapi import FastAPILocks

    locks = FastAPILocks("redis://127.0.0.1:6379/0")
    app = FastAPI(lifespan=locks.lifespan)


    @app.post("/invoices/{invoice_id}/pay")
    async def pay(
        invoice_id: int, lease: Annotated[Lease, locks.lock("invoice:{invoice_id}", ttl=30)]
    ) -> dict[str, int]:
        await charge(invoice_id, fence=lease.fence)  # one request per invoice at a time
        return {"fence": lease.fence}


    async def reconcile(term: Term) -> None:  # runs in one replica at a time
        ...


    locks.leader_task("reconciler", reconcile)

A request that cannot get the lock within ``timeout`` is answered ``423 Locked`` with a
``Retry-After`` header; see :mod:`asynclock.integrations` for every answer.

Needs FastAPI 0.121 or later (``pip install 'asynclock[fastapi]'``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, Literal

from . import _common as common

try:
    from fastapi import HTTPException, Request, params
    from fastapi.dependencies.models import Dependant
    from fastapi.routing import APIRoute
    from starlette.applications import Starlette
    from starlette.routing import BaseRoute
except ImportError as exc:
    raise common.needs_extra(__name__, "FastAPI", "fastapi", exc) from exc

from .._backoff import Backoff
from .._coordinator import Coordinator
from .._lease import Lease
from . import LeaderCallback, LeaderTaskStatus, OnError

__all__ = ("DependencyScope", "FastAPILocks", "LeaderTaskStatus", "OnError")

#: When a lock dependency releases: ``"function"`` (before the response is sent) or
#: ``"request"`` (after it was sent); see :meth:`FastAPILocks.lock`.
DependencyScope = Literal["function", "request"]


class FastAPILocks:
    """asynclock for one FastAPI app: its coordinator, lock dependencies and leader tasks.

    ``FastAPILocks(url, **connect_options)`` connects at startup with
    :func:`asynclock.connect` (a URL, or a list of Redis URLs for Redlock) and closes that
    coordinator at shutdown; ``FastAPILocks(coordinator)`` uses a coordinator the
    application owns and never closes it. Pass :meth:`lifespan` to
    ``FastAPI(lifespan=...)``, or enter it from the app's own lifespan::

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with locks.lifespan(app):
                ...  # the app's own start-up; locks.coordinator is usable here
                yield

    One instance serves one running app at a time. Raises ``TypeError`` for a target
    that is neither, or for connect options given with a coordinator.
    """

    def __init__(
        self, target: str | Sequence[str] | Coordinator, /, **connect_options: Any
    ) -> None:
        common.check_target(target, connect_options)
        self._target = target
        self._options = dict(connect_options)
        self._coord: Coordinator | None = None
        self._running = False
        self._leaders = common.LeaderTasks()
        # Every lock dependency made here, with its template: checked against the
        # routes at startup.
        self._templates: dict[Callable[..., Any], common.Template] = {}

    @property
    def coordinator(self) -> Coordinator:
        """The running app's :class:`~asynclock.Coordinator`.

        Raises ``RuntimeError`` before startup and after shutdown.
        """
        if self._coord is None:
            raise RuntimeError(
                "FastAPILocks is not running: pass locks.lifespan to FastAPI(lifespan=...) "
                "or enter it in the app's own lifespan; the coordinator exists from startup "
                "to shutdown"
            )
        return self._coord

    async def get_coordinator(self) -> Coordinator:
        """A dependency giving the coordinator to a handler:
        ``coord: Annotated[Coordinator, Depends(locks.get_coordinator)]``."""
        return self.coordinator

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The app's lifespan: connect (when built from a URL), start the leader tasks,
        and at shutdown cancel them (each resigns) and close what was connected.

        At startup, every lock dependency used by a route registered on the app (or on
        a mounted app) is checked against that route's path parameters: a template field
        the route lacks raises ``ValueError`` and the app does not start. Routes of
        included routers are checked at their first request instead (FastAPI keeps them
        behind a private structure).
        """
        if self._running:
            raise RuntimeError("this FastAPILocks is already running an app")
        self._check_routes(app.routes, frozenset())
        self._running = True
        try:
            async with common.serving(
                self._target, self._options, self._leaders, owner="FastAPILocks"
            ) as coord:
                self._coord = coord
                yield
        finally:
            self._coord = None
            self._running = False

    def lock(
        self,
        template: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = 5.0,
        scope: DependencyScope = "function",
    ) -> params.Depends:
        """A dependency that holds the lock named by ``template`` for the request and
        gives the handler its :class:`~asynclock.Lease`.

        Use it as ``lease: Annotated[Lease, locks.lock("invoice:{invoice_id}")]`` or in
        ``dependencies=[locks.lock(...)]``. ``template`` is formatted with the request's
        path parameters as Starlette gives them: strings, unless the path declares a
        converter (``/invoices/{invoice_id:int}`` makes ``/invoices/042`` and
        ``/invoices/42`` one lock; without it they are two). ``ttl`` and ``timeout`` are
        :meth:`Coordinator.lock`'s; the lease is renewed while held.

        ``scope`` is when the lock is released (FastAPI's ``Depends(scope=...)``):

        - ``"function"`` (default): when the path operation function returns, *before*
          the response is sent. A client that got its response can send the next request
          at once and never find the lock still held by its previous one; a
          ``StreamingResponse`` body and background tasks run outside the lock.
        - ``"request"``: after the response was sent (and its background tasks ran): the
          lock also covers a streamed body, and is held while a slow client reads.

        The lock is held by the request's task: when the lease is lost, the handler is
        cancelled and the request answered 503. A sync ``def`` handler runs in a thread,
        which cannot be cancelled: use ``async def``. Raises ``TypeError``/``ValueError``
        now for a bad template (only named fields), ``ttl``, ``timeout`` or ``scope``.
        """
        parsed = common.Template(template)
        ttl, timeout = common.check_lock_options(ttl, timeout)
        if scope not in ("function", "request"):
            raise ValueError(f"scope must be 'function' or 'request', got {scope!r}")
        times = common.HoldTimes()

        async def hold_lock(request: Request) -> AsyncIterator[Lease]:
            coord = self.coordinator
            route = request.scope.get("route")
            where = f"route {getattr(route, 'path', request.url.path)!r}"
            name = parsed.format(request.path_params, where)
            try:
                async with common.hold(coord, name, ttl=ttl, timeout=timeout, times=times) as lease:
                    yield lease
            except common.Refusal as refusal:
                raise HTTPException(
                    refusal.status, refusal.detail, refusal.headers or None
                ) from refusal.__cause__

        hold_lock.__qualname__ = hold_lock.__name__ = f"asynclock_lock[{template}]"
        self._templates[hold_lock] = parsed
        return params.Depends(hold_lock, scope=scope)

    def leader_task(
        self,
        name: str,
        callback: LeaderCallback,
        *,
        ttl: float = 10.0,
        identity: str | None = None,
        on_error: OnError = "restart",
        retry: Backoff | None = None,
    ) -> None:
        """Run ``callback`` in one app instance at a time among all that use election
        ``name``, from startup to shutdown.

        At startup a task campaigns on ``coord.election(name, ttl=ttl,
        identity=identity)`` and calls ``await callback(term)`` while this instance leads
        (cancelled when leadership is lost); at shutdown it is cancelled, which resigns.
        Whenever a term ends the task pauses, then campaigns again: the pause is
        ``retry``'s delay (default :data:`~asynclock.integrations.LEADER_RETRY`: up to 1
        s, doubling to at most 60 s), growing with each error or term shorter than
        ``ttl`` in a row. That holds after the callback returns (a callback that returns
        at once runs once per pause, it does not spin), after a lost leadership or a
        backend error, and, with ``on_error="restart"`` (the default), after any
        exception the callback raises (logged with its traceback on the ``asynclock``
        logger): a transient failure never stops the fleet's job. With
        ``on_error="stop"`` such an exception stops the task for good (logged; its state
        says why). :meth:`leader_status` shows each task's state.

        Raises ``RuntimeError`` once the app runs; ``TypeError`` for a callback that is
        not an ``async def`` taking the :class:`~asynclock.Term`, and
        ``TypeError``/``ValueError`` for other bad arguments or a ``name`` already
        registered.
        """
        if self._running:
            raise RuntimeError("register leader tasks before the app starts")
        self._leaders.add(
            name, callback, ttl=ttl, identity=identity, on_error=on_error, retry=retry
        )

    def leader_status(self) -> dict[str, LeaderTaskStatus]:
        """Each leader task's state by election name, for a readiness or health
        endpoint: ``{name: status.as_dict() for name, status in
        locks.leader_status().items()}``. Before startup and after shutdown every task
        is ``"stopped"``."""
        return self._leaders.status()

    def _check_routes(self, routes: Iterable[BaseRoute], inherited: frozenset[str]) -> None:
        for route in routes:
            names = inherited | frozenset(getattr(route, "param_convertors", None) or ())
            if isinstance(route, APIRoute):
                for template in self._templates_of(route.dependant):
                    problem = template.lacking(names, "the route")
                    if problem is not None:
                        raise ValueError(f"route {route.path!r}: {problem}")
                continue
            children = getattr(route, "routes", None)  # Mount and Host
            if isinstance(children, list):
                self._check_routes(children, names)

    def _templates_of(self, dependant: Dependant) -> Iterable[common.Template]:
        for sub in dependant.dependencies:
            if sub.call is not None and sub.call in self._templates:
                yield self._templates[sub.call]
            yield from self._templates_of(sub)

    def __repr__(self) -> str:
        state = repr(self._coord) if self._coord is not None else "not running"
        return f"<FastAPILocks {state} leader_tasks={self._leaders.names()}>"
