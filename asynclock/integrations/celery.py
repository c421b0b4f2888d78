"""Celery integration: a task that runs once at a time per its arguments, under a lease
renewed while it runs.

::

    from celery import Celery

    from asynclock.integrations.celery import SingletonTask

    app = Celery("shop", broker="redis://127.0.0.1:6379/0")
    app.conf.asynclock_url = "redis://127.0.0.1:6379/1"  # the lock server


    @app.task(base=SingletonTask, bind=True, lock_ttl=60, on_held="skip")
    def rebuild_report(self: SingletonTask, day: str) -> int:
        write_report(day, fence=self.lease.fence)  # one run per day at a time
        return self.lease.fence

``@app.task(base=SingletonTask, ...)`` takes the options below, as task attributes (a
subclass may set them too). A run of the task first takes the lock named from its
arguments; while it runs, the lease is renewed (every third of ``lock_ttl``) by the
coordinator's own thread; when the run ends, however it ends, the lock is released. A
worker killed mid-run (``kill -9``, an OOM kill, a lost machine) stops renewing, and the
lock is free again within ``lock_ttl``: the TTL is short because it is renewed.

- ``lock_ttl`` (default 60): seconds of the lease; the time a killed worker blocks its
  job at most.
- ``on_held`` (default ``"skip"``): what a run does when another run holds the lock:
  ``"skip"`` returns None without running (logged on the ``asynclock`` logger: at INFO,
  or WARNING when the lock server did not answer in time);
  ``"retry"`` calls Celery's ``self.retry()`` (``countdown=lock_retry_delay``, the task's
  ``max_retries``; past them the task fails with :class:`~asynclock.LockTimeout`);
  ``"wait"`` waits for the lock (up to ``lock_timeout``, then fails with
  :class:`~asynclock.LockTimeout`).
- ``lock_timeout`` (default None): how long a run waits for the lock before its
  ``on_held`` applies. None: 0 for ``"skip"`` and ``"retry"`` (try once), no limit for
  ``"wait"`` (Celery's time limits still apply).
- ``lock_retry_delay`` (default None): the retry countdown under ``"retry"``; None: the
  task's ``default_retry_delay`` (Celery's default: 180 s).
- ``lock_name`` (default None): a template formatted with the run's arguments, bound to
  the task's parameters with their defaults (``"report:{day}"``): runs whose names are
  equal exclude each other. Used as it is, so a name can be shared with locks taken
  elsewhere (``coord.lock("report:2026-12-04")``). None: ``celery:<task name>:`` and a
  digest of every argument (JSON, sorted keys, SHA-256): same arguments, same lock,
  whether given by position or by keyword.
- ``lock_coordinator`` (default None): an :class:`asynclock.sync.Coordinator` to take the
  locks with. None: one made in each process from the app's configuration,
  ``app.conf.asynclock_url`` (a URL, or a list of Redis URLs for Redlock) and
  ``app.conf.asynclock_options`` (a dict of :func:`asynclock.connect` options); from
  Django settings with ``namespace="CELERY"``, ``CELERY_ASYNCLOCK_URL``. That one is made
  on first use, is fork-safe (Celery's prefork children reconnect by themselves), and is
  closed when the worker process shuts down.

A bad option raises ``TypeError`` or ``ValueError`` when Celery builds the task's class
(at worker start-up, or on the task's first use).

Inside the task (``bind=True``), ``self.lease`` is the run's :class:`asynclock.sync.Lease`:
pass ``self.lease.fence`` to what the task writes, and call ``self.lease.check()``
between long steps. A thread cannot be stopped, so a lost lease does not stop the run:
the run goes on, ``self.lease.lost`` turns true, ``check()`` raises
:class:`~asynclock.LockLost`, and when the run ends the task fails with ``LockLost``
(its return value is dropped).

The lock is taken when the task *runs*, not when it is sent: twenty messages sent at
once for one argument while one run holds the lock run once (the others are skipped,
retried or wait); a message that arrives after that run ended runs again. Works with the
``prefork``, ``threads`` and ``solo`` pools (not ``eventlet``/``gevent``).

Needs Celery 5.3 or later (``pip install 'asynclock[celery]'``).
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
import json
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, get_args

from . import _common as common

try:
    from celery import Celery, Task  # type: ignore[import-untyped,unused-ignore]
    from celery.exceptions import ImproperlyConfigured  # type: ignore[import-untyped,unused-ignore]
    from celery.signals import (  # type: ignore[import-untyped,unused-ignore]
        worker_process_shutdown,
        worker_shutdown,
    )
except ImportError as exc:
    raise common.needs_extra(__name__, "Celery", "celery", exc) from exc

from .._decorators import namer, template_fields
from .._errors import LockTimeout
from .._validate import check_number, check_ttl
from ..sync import Coordinator, Lease, connect
from ..sync._decorators import run_held

__all__ = ("OnHeld", "SingletonTask", "coordinator_for")

logger = logging.getLogger("asynclock")

#: What a run does when another run holds its lock: ``"skip"`` (return None),
#: ``"retry"`` (Celery's ``self.retry()``) or ``"wait"`` (wait for the lock).
OnHeld = Literal["skip", "retry", "wait"]

_ON_HELD: tuple[str, ...] = get_args(OnHeld)
_OPTIONS = (
    "lock_coordinator",
    "lock_name",
    "lock_retry_delay",
    "lock_timeout",
    "lock_ttl",
    "on_held",
)

# The lease of the run in progress in this thread (a run inside a run: the inner one).
_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "asynclock_celery_lease", default=None
)


class SingletonTask(Task):  # type: ignore[misc]  # Celery has no type hints
    """A Celery task base: one run at a time per lock name (from the run's arguments),
    under a lease renewed while the run works and released when it ends.

    Use it as ``@app.task(base=SingletonTask, lock_ttl=..., on_held=..., ...)``; see
    :mod:`asynclock.integrations.celery` for the options, which are class attributes.
    """

    #: Seconds of the lease (renewed every third of it while the run works).
    lock_ttl: ClassVar[float] = 60.0
    #: What a run does when the lock is held: ``"skip"``, ``"retry"`` or ``"wait"``.
    on_held: ClassVar[OnHeld] = "skip"
    #: Seconds to wait for the lock before ``on_held`` applies (None: 0 for skip and
    #: retry, no limit for wait).
    lock_timeout: ClassVar[float | None] = None
    #: The retry countdown under ``on_held="retry"`` (None: ``default_retry_delay``).
    lock_retry_delay: ClassVar[float | None] = None
    #: A template of the lock name, formatted with the run's arguments (None: the task's
    #: name and a digest of its arguments).
    lock_name: ClassVar[str | None] = None
    #: The coordinator to lock with (None: one per process from ``app.conf.asynclock_url``).
    lock_coordinator: ClassVar[Coordinator | None] = None

    _lock_namer: ClassVar[Callable[[tuple[Any, ...], dict[str, Any]], str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check the lock options when Celery builds the task class."""
        super().__init_subclass__(**kwargs)
        _check_options(cls)
        cls._lock_namer = None  # made on first use, from this class's ``run``

    @property
    def lease(self) -> Lease:
        """The lease of this task's run in progress (in the calling thread).

        Raises ``RuntimeError`` outside a run (the lease exists only while the task's
        body runs in a worker, or in a direct or eager call).
        """
        lease = _current.get()
        if lease is None:
            raise RuntimeError(f"{self.name}: no lease: self.lease exists only while the task runs")
        return lease

    def lock_name_for(
        self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """The lock name of a run with ``args`` and ``kwargs`` (what ``inspect()`` and
        ``is_locked()`` on the coordinator take, to see whether such a run holds it)."""
        args = tuple(args)
        kwargs = dict(kwargs or {})
        name_for = type(self)._lock_namer
        if name_for is None:
            name_for = _namer_for(self)
            type(self)._lock_namer = name_for
        return name_for(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task under its lock: take it (or skip, retry or wait, as ``on_held``
        says), run the body, release it."""
        coord = self.lock_coordinator
        if coord is None:
            coord = coordinator_for(self.app)
        timeout = self.lock_timeout
        if timeout is None:
            timeout = None if self.on_held == "wait" else 0.0
        lock = coord.lock(self.lock_name_for(args, kwargs), ttl=self.lock_ttl, timeout=timeout)
        try:
            lease = lock.__enter__()
        except LockTimeout as held:
            if self.on_held == "skip":
                # Contention (INFO), or a server that did not answer in time (WARNING:
                # the LockTimeout then has a cause); its message says which.
                level = logging.INFO if held.__cause__ is None else logging.WARNING
                logger.log(level, "task %s[%s] skipped: %s", self.name, self.request.id, held)
                return None
            if self.on_held == "retry":
                raise self.retry(exc=held, countdown=self.lock_retry_delay) from held
            raise
        try:
            token = _current.set(lease)
            try:
                return run_held(lock, super().__call__, args, kwargs)
            finally:
                _current.reset(token)
        except BaseException:
            # Celery raises SoftTimeLimitExceeded into the thread on any line, also
            # between the grant and the body: the lease goes back whatever happened.
            lock.give_back_entered()  # a no-op once the block was left
            raise


def _check_options(cls: type[SingletonTask]) -> None:
    """``TypeError``/``ValueError`` for a bad lock option of ``cls``, naming the task."""
    label = f"task {cls.name!r}" if getattr(cls, "name", None) else cls.__qualname__
    try:
        _check(cls)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{label}: {exc}") from None


def _check(cls: type[SingletonTask]) -> None:
    for key, value in vars(cls).items():
        if key.startswith("lock_") and key not in _OPTIONS and not callable(value):
            raise TypeError(f"unknown option {key}=; SingletonTask takes {', '.join(_OPTIONS)}")
    if cls.on_held not in _ON_HELD:
        raise ValueError(
            f"on_held must be one of {', '.join(map(repr, _ON_HELD))}, got {cls.on_held!r}"
        )
    check_ttl(cls.lock_ttl, "lock_ttl")
    if cls.lock_timeout is not None:
        check_number("lock_timeout", cls.lock_timeout)
    if cls.lock_retry_delay is not None:
        check_number("lock_retry_delay", cls.lock_retry_delay)
    coord = cls.lock_coordinator
    if coord is not None and not isinstance(coord, Coordinator):
        raise TypeError(
            "lock_coordinator must be an asynclock.sync.Coordinator "
            f"(asynclock.sync.connect(url)), got {type(coord).__name__}"
        )
    if cls.lock_name is not None:
        fields = template_fields(cls.lock_name, what="task's parameters")
        parameters = _parameters(cls)
        if parameters is not None and (missing := sorted(fields - set(parameters))):
            raise ValueError(
                f"lock_name {cls.lock_name!r} names {missing[0]!r}, which the task does not "
                f"take (its parameters: {', '.join(parameters) or 'none'})"
            )


def _parameters(cls: type[SingletonTask]) -> list[str] | None:
    """The names of the parameters a run of ``cls`` binds its arguments to (None while
    the class has no ``run`` of its own: a base of tasks)."""
    run = inspect.getattr_static(cls, "run")
    if isinstance(run, staticmethod):  # @app.task without bind=True
        return list(inspect.signature(run.__func__).parameters)
    if inspect.isfunction(run) and run is not Task.run:  # bind=True, or a class's method
        return list(inspect.signature(run).parameters)[1:]
    return None


def _namer_for(task: SingletonTask) -> Callable[[tuple[Any, ...], dict[str, Any]], str]:
    """From a run's arguments to its lock name, for ``task``'s class."""
    if task.lock_name is not None:
        return namer(task.lock_name, task.run)
    signature = inspect.signature(task.run)
    prefix = f"celery:{task.name}:"

    def name_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # the run itself will say what is wrong with these arguments
            what: object = ["call", list(args), kwargs]
        else:
            bound.apply_defaults()
            what = ["bound", bound.arguments]
        try:
            text = json.dumps(what, sort_keys=True, separators=(",", ":"), default=common.jsonable)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{task.name}: cannot name its lock from these arguments ({exc}); give the "
                "task lock_name='...{parameter}...' to name it from the arguments that matter"
            ) from None
        return prefix + hashlib.sha256(text.encode()).hexdigest()[:32]

    return name_for


# -- the coordinator of each app, in each process ---------------------------------------

_made: weakref.WeakKeyDictionary[Any, Coordinator] = weakref.WeakKeyDictionary()
_made_lock = threading.Lock()


def coordinator_for(app: Celery) -> Coordinator:
    """The :class:`asynclock.sync.Coordinator` that ``app``'s singleton tasks use in
    this process (unless they have a ``lock_coordinator``): made on first use from
    ``app.conf.asynclock_url`` and ``app.conf.asynclock_options``, kept, and closed when
    the worker process shuts down. Usable in the app's own code (``inspect()``).

    Raises ``celery.exceptions.ImproperlyConfigured`` when ``asynclock_url`` is not set.
    """
    coord = _made.get(app)
    if coord is not None and not coord.closed:
        return coord
    with _made_lock:
        coord = _made.get(app)
        if coord is None or coord.closed:
            url = app.conf.get("asynclock_url")
            if not url:
                raise ImproperlyConfigured(
                    "asynclock's SingletonTask needs a lock server: set "
                    "app.conf.asynclock_url = 'redis://...' (CELERY_ASYNCLOCK_URL in Django "
                    "settings read with namespace='CELERY'), or give the task "
                    "lock_coordinator=asynclock.sync.connect(url)"
                )
            options = app.conf.get("asynclock_options") or {}
            if not isinstance(options, Mapping):
                raise ImproperlyConfigured(
                    f"asynclock_options must be a dict of asynclock.connect() options, got "
                    f"{type(options).__name__}"
                )
            coord = connect(url, **options)
            _made[app] = coord
        return coord


def _close_made(**_: object) -> None:
    """At worker (process) shutdown: close the coordinators made here (their leases
    released, their connections closed)."""
    with _made_lock:
        made = list(_made.values())
        _made.clear()
    for coord in made:
        try:
            coord.close()
        except Exception:  # shutting down: report, and close the others
            logger.warning("closing the asynclock coordinator failed", exc_info=True)


worker_process_shutdown.connect(_close_made, weak=False)
worker_shutdown.connect(_close_made, weak=False)
