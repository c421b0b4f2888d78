"""asynclock.sync: the blocking API, for threads and plain functions (Django views,
Celery tasks, scripts).

::

    import asynclock.sync

    with asynclock.sync.connect("redis://127.0.0.1:6379/0") as coord:
        with coord.lock("invoice:42", ttl=30, timeout=5) as lease:
            charge(invoice, fence=lease.fence)

The same concepts, arguments, defaults and errors as :mod:`asynclock`, blocking. One
event loop per coordinator, in a daemon thread of its own, runs the async core: leases
are renewed there while the calling threads work.

**A lost lease does not stop its block.** A thread cannot be cancelled. When a lease is
lost (a renewal was refused, or its validity ran out), ``lease.lost`` turns true,
``lease.check()`` raises :class:`~asynclock.LockLost`, the lock's ``on_lost`` callback
runs in a thread of its own, and leaving the ``with`` block raises ``LockLost``. Long work
calls ``lease.check()`` between its steps, and passes ``lease.fence`` to what it writes:
the fence is what stops a late writer.
"""

from .._errors import BackendError as BackendError
from .._errors import CoordinatorClosed as CoordinatorClosed
from .._errors import LeadershipLost as LeadershipLost
from .._errors import LockError as LockError
from .._errors import LockLost as LockLost
from .._errors import LockNotOwned as LockNotOwned
from .._errors import LockTimeout as LockTimeout
from ._coordinator import Coordinator as Coordinator
from ._coordinator import connect as connect
from ._election import Election as Election
from ._election import Leadership as Leadership
from ._election import Term as Term
from ._lock import Lease as Lease
from ._lock import Lock as Lock
from ._lock import ReadWriteLock as ReadWriteLock

__all__ = (
    "BackendError",
    "Coordinator",
    "CoordinatorClosed",
    "Election",
    "Leadership",
    "LeadershipLost",
    "Lease",
    "Lock",
    "LockError",
    "LockLost",
    "LockNotOwned",
    "LockTimeout",
    "ReadWriteLock",
    "Term",
    "connect",
)

for _name in ("Coordinator", "Election", "Leadership", "Lease", "Lock", "ReadWriteLock", "Term"):
    globals()[_name].__module__ = "asynclock.sync"
del _name
