"""aiohttp integration: a coordinator for the application's lifetime, handlers locked by
a name from the URL, and leader-only background tasks.

::

    from aiohttp import web

    from asynclock.integrations.aiohttp import COORDINATOR, LEASE, leader_task, locked, setup

    routes = web.RouteTableDef()


    @routes.post("/invoices/{invoice_id}/pay")
    @locked("invoice:{invoice_id}", ttl=30)
    async def pay(request: web.Request) -> web.Response:
        lease = request[LEASE]  # one request per invoice at a time
        await charge(request.match_info["invoice_id"], fence=lease.fence)
        return web.json_response({"fence": lease.fence})


    app = web.Application()
    app.add_routes(routes)
    setup(app, "redis://127.0.0.1:6379/0")
    leader_task(app, "reconciler", reconcile)  # reconcile(term) runs in one replica at a time

A request that cannot get the lock within ``timeout`` is answered ``423 Locked``
(:class:`HTTPLocked`) with a ``Retry-After`` header; see :mod:`asynclock.integrations`
for every answer.

Needs aiohttp 3.14 or later (``pip install 'asynclock[aiohttp]'``).
"""

from __future__ import annotations

import functools
import inspect
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, cast

from . import _common as common

try:
    from aiohttp import hdrs, web
except ImportError as exc:
    raise common.needs_extra(__name__, "aiohttp", "aiohttp", exc) from exc

from .._backoff import Backoff
from .._coordinator import Coordinator
from .._lease import Lease
from . import LeaderCallback, LeaderTaskStatus, OnError

__all__ = (
    "COORDINATOR",
    "LEASE",
    "HTTPLocked",
    "LeaderTaskStatus",
    "OnError",
    "leader_status",
    "leader_task",
    "locked",
    "setup",
)

#: Where :func:`setup` keeps the coordinator while the application runs:
#: ``request.config_dict[COORDINATOR]`` (also from sub-applications) or
#: ``app[COORDINATOR]``.
COORDINATOR: Final = web.AppKey("COORDINATOR", Coordinator)

#: The :class:`~asynclock.Lease` that :func:`locked` holds for the handler:
#: ``request[LEASE]`` (the innermost one when several ``@locked`` are stacked).
LEASE: Final = web.RequestKey("LEASE", Lease)

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[web.StreamResponse]])

_TEMPLATE_ATTR = "__asynclock_template__"


@dataclass(slots=True)
class _AppState:
    target: str | Sequence[str] | Coordinator
    options: dict[str, Any]
    leaders: common.LeaderTasks = field(default_factory=common.LeaderTasks)


_STATE: Final = web.AppKey("asynclock_state", _AppState)


class HTTPLocked(web.HTTPClientError):
    """``423 Locked``: the resource's lock is held by another request (aiohttp has no
    class for it). :func:`locked` raises it with a ``Retry-After`` header."""

    status_code = 423


_ERRORS: dict[int, type[web.HTTPError]] = {
    400: web.HTTPBadRequest,
    423: HTTPLocked,
    503: web.HTTPServiceUnavailable,
}


def setup(
    app: web.Application, target: str | Sequence[str] | Coordinator, /, **connect_options: Any
) -> None:
    """Give ``app`` a coordinator from startup to cleanup, under :data:`COORDINATOR`.

    ``target`` is a URL (or a list of Redis URLs for Redlock) for
    :func:`asynclock.connect` with ``connect_options``: connected at startup and closed
    at cleanup; or a :class:`~asynclock.Coordinator` the application owns, never closed
    here. Registers a ``cleanup_ctx`` that also starts the :func:`leader_task` tasks
    and, at cleanup, cancels them (each resigns) before closing the coordinator.

    At startup, every :func:`locked` handler routed in the app (and its sub-apps) is
    checked against its resource's path parameters: a template field the resource lacks
    raises ``ValueError`` and the app does not start.

    Raises ``RuntimeError`` if called twice or once the app has started,
    ``TypeError`` for a target that is neither, or connect options given with a
    coordinator.
    """
    if _STATE in app:
        raise RuntimeError("asynclock setup() was already called for this app")
    if app.pre_frozen:
        raise RuntimeError("call asynclock setup() before the app starts")
    common.check_target(target, connect_options)
    app[_STATE] = _AppState(target, dict(connect_options))
    app.cleanup_ctx.append(_lifetime)


def leader_task(
    app: web.Application,
    name: str,
    callback: LeaderCallback,
    *,
    ttl: float = 10.0,
    identity: str | None = None,
    on_error: OnError = "restart",
    retry: Backoff | None = None,
) -> None:
    """Run ``callback`` in one application instance at a time among all that use
    election ``name``, from startup to cleanup.

    At startup a task campaigns on ``coord.election(name, ttl=ttl, identity=identity)``
    and calls ``await callback(term)`` while this instance leads (cancelled when
    leadership is lost); at cleanup it is cancelled, which resigns. Whenever a term ends
    the task pauses, then campaigns again: the pause is ``retry``'s delay (default
    :data:`~asynclock.integrations.LEADER_RETRY`: up to 1 s, doubling to at most 60 s),
    growing with each error or term shorter than ``ttl`` in a row. That holds after the
    callback returns (a callback that returns at once runs once per pause, it does not
    spin), after a lost leadership or a backend error, and, with ``on_error="restart"``
    (the default), after any exception the callback raises (logged with its traceback on
    the ``asynclock`` logger): a transient failure never stops the fleet's job. With
    ``on_error="stop"`` such an exception stops the task for good (logged; its state
    says why). :func:`leader_status` shows each task's state.

    Raises ``RuntimeError`` before :func:`setup` or once the app has started;
    ``TypeError`` for a callback that is not an ``async def`` taking the
    :class:`~asynclock.Term`, and ``TypeError``/``ValueError`` for other bad arguments or
    a ``name`` already registered.
    """
    state = app.get(_STATE)
    if state is None:
        raise RuntimeError("call asynclock setup(app, ...) before leader_task(app, ...)")
    if app.pre_frozen:
        raise RuntimeError("register leader tasks before the app starts")
    state.leaders.add(name, callback, ttl=ttl, identity=identity, on_error=on_error, retry=retry)


def leader_status(app: web.Application | web.Request) -> dict[str, LeaderTaskStatus]:
    """Each leader task's state by election name, for a readiness or health endpoint.

    ``app`` is the application :func:`setup` was called on, or a request to it or to
    one of its sub-applications (``leader_status(request)`` in a handler). Before
    startup and after cleanup every task is ``"stopped"``. Raises ``RuntimeError`` when
    :func:`setup` was not called.
    """
    state = app.config_dict.get(_STATE) if isinstance(app, web.Request) else app.get(_STATE)
    if state is None:
        raise RuntimeError("call asynclock setup(app, ...) before leader_status()")
    return state.leaders.status()


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    state = app[_STATE]
    _check_routes(app)
    async with common.serving(
        state.target, state.options, state.leaders, owner="asynclock setup()"
    ) as coord:
        app[COORDINATOR] = coord
        yield


def locked(
    template: str, *, ttl: float = 30.0, timeout: float | None = 5.0
) -> Callable[[Handler], Handler]:
    """Decorate a handler to run under the lock named by ``template``, formatted with
    ``request.match_info`` (``"invoice:{invoice_id}"``); the handler finds the
    :class:`~asynclock.Lease` at ``request[LEASE]``.

    Works on function handlers (``async def handler(request)``), methods of
    ``web.View`` classes (``async def post(self)``) and handler methods taking the
    request (``async def handler(self, request)``). Not acquired within ``timeout``:
    :class:`HTTPLocked` (423) with ``Retry-After``. The lock is held until the handler
    returns; aiohttp sends a returned response after that, so the lock is released
    before the client gets it (a handler that streams with ``StreamResponse.prepare()``
    and ``write()`` does so under the lock). When the lease is lost, the handler is
    cancelled and the request answered 503. Needs :func:`setup` on the application.

    Raises ``TypeError``/``ValueError`` now for a bad template (only named fields),
    ``ttl`` or ``timeout``, or a handler that is not an ``async def``.
    """
    parsed = common.Template(template)
    ttl, timeout = common.check_lock_options(ttl, timeout)

    def decorate(handler: Handler) -> Handler:
        if not inspect.iscoroutinefunction(handler):
            shown = getattr(handler, "__qualname__", handler)
            raise TypeError(f"@locked needs an async def handler, got {shown!r}")
        times = common.HoldTimes()

        @functools.wraps(handler)
        async def locked_handler(*args: Any, **kwargs: Any) -> web.StreamResponse:
            request = _request_of(args)
            coord = request.config_dict.get(COORDINATOR)
            if coord is None:
                raise RuntimeError(
                    "no asynclock coordinator: call asynclock.integrations.aiohttp.setup(app, "
                    "...) on this application (or a parent) before it starts"
                )
            resource = request.match_info.route.resource
            where = f"resource {resource.canonical if resource else request.path!r}"
            name = parsed.format(request.match_info, where)
            try:
                async with common.hold(coord, name, ttl=ttl, timeout=timeout, times=times) as lease:
                    request[LEASE] = lease
                    return await handler(*args, **kwargs)
            except common.Refusal as refusal:
                raise _ERRORS[refusal.status](
                    text=refusal.detail, headers=refusal.headers
                ) from refusal.__cause__

        setattr(locked_handler, _TEMPLATE_ATTR, parsed)
        return cast(Handler, locked_handler)

    return decorate


def _request_of(args: Sequence[object]) -> web.Request:
    for arg in args:
        if isinstance(arg, web.Request):
            return arg
        if isinstance(arg, web.View):
            return arg.request
    raise TypeError(
        "@locked handlers take the request (async def handler(request)) or are methods "
        "of a web.View"
    )


def _check_routes(app: web.Application) -> None:
    for resource in app.router.resources():
        info = resource.get_info()
        sub = info.get("app")
        if isinstance(sub, web.Application):
            _check_routes(sub)
            continue
        formatter = info.get("formatter")
        names = (
            {f for _, f, _, _ in string.Formatter().parse(formatter) if f}
            if isinstance(formatter, str)
            else set()
        )
        for route in resource:
            for handler in _handlers(route.handler):
                template = getattr(handler, _TEMPLATE_ATTR, None)
                if not isinstance(template, common.Template):
                    continue
                problem = template.lacking(names, "the resource")
                if problem is not None:
                    raise ValueError(f"resource {resource.canonical!r}: {problem}")


def _handlers(handler: object) -> Iterable[object]:
    """The functions behind a route's handler: itself, or a View class's methods."""
    if isinstance(handler, type) and issubclass(handler, web.View):
        return [getattr(handler, method.lower(), None) for method in hdrs.METH_ALL]
    return [handler]
