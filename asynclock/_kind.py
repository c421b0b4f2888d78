"""The kinds of claim a backend grants (:class:`Kind`, public as
``asynclock.backends.Kind``), and its members as module globals.

Reading ``Kind.X`` goes through the enum metaclass's ``__getattr__`` slot on Python 3.11
(about 0.17 µs, against 0.01 µs for a global), and a lease reads kinds several times on
its way: the engine's and the backends' hot paths import the globals instead.
"""

from __future__ import annotations

import enum

__all__ = ("EXCLUSIVE", "FAIR", "PERMIT", "SHARED", "Kind")


class Kind(enum.Enum):
    """What a :class:`Claim` asks for. A backend lists the kinds it grants in
    :attr:`Backend.kinds`; the coordinator refuses the others before sending anything."""

    #: A lock: one holder at a time. Also a read-write lock's writer, which excludes
    #: readers too.
    EXCLUSIVE = "exclusive"
    #: A lock granted in arrival order: an attempt is refused while a live waiter that
    #: came earlier is queued, and a release wakes the first in line.
    FAIR = "fair"
    #: A reader of a read-write lock: readers share the name, an exclusive claim (the
    #: writer) excludes everyone. Writers are preferred: once a writer was refused, new
    #: readers are refused until it got the lock (or gave up and its place lapsed), so a
    #: stream of readers cannot starve it.
    SHARED = "shared"
    #: One of ``limit`` permits of the counting semaphore ``name``: at most ``limit``
    #: holders at once, each with its own expiry and fence. Semaphores live apart from
    #: locks of the same name.
    PERMIT = "permit"


EXCLUSIVE, FAIR, SHARED, PERMIT = Kind.EXCLUSIVE, Kind.FAIR, Kind.SHARED, Kind.PERMIT
