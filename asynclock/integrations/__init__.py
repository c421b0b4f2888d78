"""Integrations: the web frameworks (``asynclock.integrations.fastapi`` and
``asynclock.integrations.aiohttp``) and the job queues (``asynclock.integrations.celery``,
``asynclock.integrations.arq``).

Each needs its framework (``pip install 'asynclock[fastapi]'``, ``'asynclock[aiohttp]'``,
``'asynclock[celery]'``, ``'asynclock[arq]'``); importing one without it raises an
``ImportError`` that names the extra. This package itself imports none of them. It holds
what the web frameworks share — lock names from URL templates, the HTTP answers to a
refused or lost lock, and the leader-only background tasks — in a private module,
``_common``; this package holds the public names of leader tasks.

The HTTP answers, on both frameworks:

- ``423 Locked`` with ``Retry-After`` when another holder kept the lock past ``timeout``
  (contention, and only that: after a timeout the server is asked who holds the lock).
  The hint is whole seconds, at least 1: how long this route's requests held the lock
  recently (a moving average of the holds this process saw end), rounded up, and never
  more than the holder's remaining TTL; before any hold of the route ended here, the
  holder's remaining TTL rounded up (1 when unknown). A renewed lease's TTL says little
  about when its holder finishes (it is topped up every third of it), the typical hold
  time does;
- ``503 Service Unavailable`` with ``Retry-After: 1`` when the lock server cannot be
  reached (:class:`~asynclock.BackendError`, raised at once whatever the timeout), or
  when ``timeout`` ran out with the server not answering (and it does not answer, or
  names no holder, when asked who holds the lock);
- ``503 Service Unavailable`` when the lease was lost while the handler ran (the handler
  was cancelled; what it did before is not undone: that is what fences are for) — unless
  the response had already started (a streamed body under FastAPI's
  ``scope="request"``): its status was sent, so the stream is cut instead, the client
  sees an incomplete body (the connection closes before the body's end), and the loss
  is logged;
- ``400 Bad Request`` when the lock name built from the URL is not a valid lock name
  (longer than 1024 UTF-8 bytes).

When the handler has finished and the release fails (the server did not confirm), the
handler's outcome stands — its response, or its own exception such as an
``HTTPException(404)`` — and the failure is logged and counted in
``stats().release_failures``; the release goes on in the background until the server
confirms or the TTL ends. A 500 would invite the client to retry a request that
completed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from .._backoff import Backoff
from .._election import Term

__all__ = (
    "LEADER_RETRY",
    "LeaderCallback",
    "LeaderState",
    "LeaderTaskStatus",
    "OnError",
)

#: A leader-only job: called with the :class:`~asynclock.Term` while this instance leads.
LeaderCallback = Callable[[Term], Awaitable[object]]

#: What a leader task does when its callback raises an unexpected exception:
#: ``"restart"`` (campaign again after its backoff) or ``"stop"`` (end the task).
OnError = Literal["restart", "stop"]

#: Where a leader task is: ``"campaigning"`` (waiting to lead), ``"leading"`` (its
#: callback runs), ``"backing_off"`` (a term or attempt ended; it campaigns again after a
#: pause), ``"stopped"`` (not running: before startup, after shutdown, or ended by an
#: error under ``on_error="stop"``).
LeaderState = Literal["campaigning", "leading", "backing_off", "stopped"]

#: The default pauses of a leader task between terms: up to 1 s after the first failure or
#: short term, doubling to at most a minute (full jitter).
LEADER_RETRY = Backoff(initial=1.0, maximum=60.0)


@dataclass(frozen=True, slots=True)
class LeaderTaskStatus:
    """A snapshot of one leader task, for a readiness or health endpoint.

    ``name``: the election; ``state``: see :data:`LeaderState`; ``identity``: this
    instance's candidate identity (None before startup); ``term``: the term's fence while
    leading, else None; ``terms``: terms led since startup; ``failures``: terms and
    attempts that ended by an error, in a row (a term that lasted a ``ttl`` starts the
    count again); ``error``: the last of those errors (``"ValueError: bad row"``);
    ``retry_in``: seconds until the next campaign while ``"backing_off"``; ``detail``: a
    sentence saying the same.
    """

    name: str
    state: LeaderState
    identity: str | None
    term: int | None
    terms: int
    failures: int
    error: str | None
    retry_in: float | None
    detail: str

    @property
    def running(self) -> bool:
        """False once the task stopped (or before it started): nothing will run its job
        on this instance."""
        return self.state != "stopped"

    def as_dict(self) -> dict[str, object]:
        """The snapshot as a JSON-ready dict (``running`` included)."""
        return {
            "name": self.name,
            "state": self.state,
            "running": self.running,
            "identity": self.identity,
            "term": self.term,
            "terms": self.terms,
            "failures": self.failures,
            "error": self.error,
            "retry_in": self.retry_in,
            "detail": self.detail,
        }
