"""Cancel an operation at exactly its k-th suspension point (for test_cancel_points.py).

:class:`Stepper` drives a coroutine's ``__await__`` by hand inside the task that awaits
it. Each time the coroutine yields a future to the task (a suspension), the stepper
records a label for that point; at the k-th one it calls ``Task.cancel()`` on the running
task just before passing the future on, so the real task machinery cancels exactly the
future the task is about to wait on (or, for a bare ``yield``, throws ``CancelledError``
at that point on the next step). Nothing depends on timing.

:func:`instrument` wraps a backend's methods on the instance (the library is untouched)
so that each suspension is labelled with the backend call it happened in
(``try_acquire``, ``waiter.exit``, ``publish:elected``, ...) and whether the server had
already granted the operation's request ("+granted"). The run's :class:`Probe` also tells
a contender (tests/test_cancel_contender.py) of each grant as it is answered and of the
releases on their way.
"""

from __future__ import annotations

import asyncio
import contextvars
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar, cast

from asynclock.backends.base import Attempt, Backend

__all__ = (
    "CANCEL_MESSAGE",
    "Probe",
    "Stepper",
    "TaskOwners",
    "instrument",
    "owner",
    "phase",
    "reporting",
)

T = TypeVar("T")

CANCEL_MESSAGE = "cancel-points: cancelled at a chosen suspension"

_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("cancel_points_phase", default="")
_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar(
    "cancel_points_probe", default=None
)
_OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("cancel_points_owner", default="")


class owner:
    """Tasks created inside the block (and by the tasks they create, and by timers
    armed there) count as ``name``'s (see :class:`TaskOwners`)."""

    __slots__ = ("_name", "_outer")

    def __init__(self, name: str) -> None:
        self._name = name
        self._outer = ""

    def __enter__(self) -> None:
        self._outer = _OWNER.get()
        _OWNER.set(self._name)

    def __exit__(self, *exc: object) -> None:
        _OWNER.set(self._outer)


class TaskOwners:
    """A task factory that notes, for each task, the owner whose context created it:
    asynclock's background tasks (give-backs, renewals, subscribers, stragglers) inherit
    the context of the call that started them, so tasks left by one coordinator can be
    told from those of another in the same loop."""

    def __init__(self) -> None:
        self.of: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: Any = None

    def __enter__(self) -> TaskOwners:
        loop = self._loop = asyncio.get_running_loop()
        self._previous = loop.get_task_factory()
        loop.set_task_factory(self._factory)  # type: ignore[arg-type]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.set_task_factory(self._previous)

    def _factory(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any],
        **kwargs: Any,
    ) -> asyncio.Task[Any]:
        task: asyncio.Task[Any]
        if self._previous is not None:
            task = self._previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        context = kwargs.get("context")
        self.of[task] = (
            context[_OWNER] if context is not None and _OWNER in context else _OWNER.get()
        )
        return task

    def alive(self, name: str) -> list[asyncio.Task[Any]]:
        """Tasks of ``name`` that have not finished."""
        return [task for task, who in list(self.of.items()) if who == name and not task.done()]


@dataclass
class Probe:
    """Per-run state the instrumented backend reports into (set in the op's task).

    ``on_grant(fence)`` is called (synchronously, in the task that made the call) as soon
    as a ``try_acquire`` answers with a grant; ``releasing`` holds the tokens of the claims
    whose ``release`` is on its way (from the call until its answer or failure).
    """

    granted: bool = False
    labels: list[str] = field(default_factory=list)
    on_grant: Callable[[int], None] | None = None
    releasing: set[str] = field(default_factory=set)

    def label(self) -> str:
        where = _PHASE.get() or "core"
        return f"{where}+granted" if self.granted else where


class reporting:
    """Calls made inside the block (in this task, and tasks it starts there) report into
    ``probe`` as the operation's own do (grants and releases; no labels)."""

    __slots__ = ("_outer", "_probe")

    def __init__(self, probe: Probe) -> None:
        self._probe = probe
        self._outer: Probe | None = None

    def __enter__(self) -> None:
        self._outer = _PROBE.get()
        _PROBE.set(self._probe)

    def __exit__(self, *exc: object) -> None:
        _PROBE.set(self._outer)


class phase:
    """Label the suspensions inside the block (restores the outer label after)."""

    __slots__ = ("_label", "_outer")

    def __init__(self, label: str) -> None:
        self._label = label
        self._outer = ""

    def __enter__(self) -> None:
        self._outer = _PHASE.get()
        _PHASE.set(self._label)

    def __exit__(self, *exc: object) -> None:
        _PHASE.set(self._outer)


class Stepper(Generic[T]):
    """``await Stepper(coro, k)``: run ``coro``, cancelling the task at its k-th suspension
    (and with ``again=n`` once more at its (k+n)-th).

    ``cancel_at=None`` never cancels (a trace of the whole path). After the run,
    ``labels`` holds one label per suspension seen, and ``requested`` says whether the
    cancel was sent (the operation reached its k-th suspension).
    """

    def __init__(
        self, coro: Coroutine[Any, Any, T], cancel_at: int | None, *, again: int = 0
    ) -> None:
        self._coro = coro
        self.cancel_at = cancel_at
        # > 0: cancel once more, that many suspensions after the first cancel (a second
        # cancel landing while the first one's clean-up is on its way).
        self.again = again
        self.probe = Probe()
        self.requested = False

    @property
    def labels(self) -> list[str]:
        return self.probe.labels

    def __await__(self) -> Generator[Any, Any, T]:
        _PROBE.set(self.probe)  # the awaiting task's context: the backend wrappers see it
        it: Generator[Any, Any, T] = self._coro.__await__()
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                out = it.send(sent) if thrown is None else it.throw(thrown)
            except StopIteration as stop:
                return cast(T, stop.value)
            labels = self.probe.labels
            labels.append(self.probe.label())
            if len(labels) == self.cancel_at or (
                self.again and self.cancel_at and len(labels) == self.cancel_at + self.again
            ):
                task = asyncio.current_task()
                assert task is not None
                self.requested = True
                task.cancel(CANCEL_MESSAGE)
            try:
                sent = yield out
                thrown = None
            except GeneratorExit:
                it.close()
                raise
            except BaseException as exc:  # passed on into the coroutine
                sent = None
                thrown = exc


class _PhasedCM(Generic[T]):
    """An async context manager whose enter and exit suspensions carry a label."""

    __slots__ = ("_inner", "_label")

    def __init__(self, inner: AbstractAsyncContextManager[T], label: str) -> None:
        self._inner = inner
        self._label = label

    async def __aenter__(self) -> T:
        with phase(f"{self._label}.enter"):
            return await self._inner.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        with phase(f"{self._label}.exit"):
            return await self._inner.__aexit__(exc_type, exc, tb)


def _wrap(
    original: Callable[..., Awaitable[Any]], label: Callable[..., str], *, release: bool = False
) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        probe = _PROBE.get()
        releasing = probe.releasing if release and probe is not None else None
        token: str = args[0].token if releasing is not None else ""
        if releasing is not None:
            releasing.add(token)
        try:
            with phase(label(*args, **kwargs)):
                result = await original(*args, **kwargs)
        finally:
            if releasing is not None:
                releasing.discard(token)
        if isinstance(result, Attempt) and result.fence is not None and probe is not None:
            probe.granted = True
            if probe.on_grant is not None:
                probe.on_grant(result.fence)
        return result

    return wrapper


def instrument(backend: Backend) -> None:
    """Label the suspensions in ``backend``'s calls (instance attributes only)."""
    methods: dict[str, Callable[..., str]] = {
        "try_acquire": lambda *a, **k: "try_acquire",
        "release": lambda *a, **k: "release",
        "extend": lambda *a, **k: "extend",
        "inspect": lambda *a, **k: "inspect",
        "publish": lambda topic, message: f"publish:{message.split(' ', 1)[0]}",
    }
    for name, label in methods.items():
        setattr(backend, name, _wrap(getattr(backend, name), label, release=name == "release"))
    for name in ("waiter", "listen"):
        original = getattr(backend, name)

        def make(
            original: Callable[[str], AbstractAsyncContextManager[Any]], name: str
        ) -> Callable[[str], AbstractAsyncContextManager[Any]]:
            return lambda arg: _PhasedCM(original(arg), name)

        setattr(backend, name, make(original, name))
