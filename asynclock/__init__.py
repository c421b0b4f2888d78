"""asynclock: asyncio-native distributed locks and leases on Redis, PostgreSQL and in memory.

::

    import asynclock

    async with asynclock.connect("redis://127.0.0.1:6379/0") as coord:
        async with coord.lock("invoice:42", ttl=30, timeout=5) as lease:
            await charge(invoice, fence=lease.fence)
"""

import logging as _logging

from ._backoff import Backoff as Backoff
from ._coordinator import Coordinator as Coordinator
from ._coordinator import connect as connect
from ._election import Election as Election
from ._election import Leadership as Leadership
from ._election import Term as Term
from ._errors import BackendError as BackendError
from ._errors import CoordinatorClosed as CoordinatorClosed
from ._errors import LeadershipLost as LeadershipLost
from ._errors import LockError as LockError
from ._errors import LockLost as LockLost
from ._errors import LockNotOwned as LockNotOwned
from ._errors import LockTimeout as LockTimeout
from ._errors import QuorumError as QuorumError
from ._lease import Lease as Lease
from ._lock import Lock as Lock
from ._lock import ReadWriteLock as ReadWriteLock
from ._stats import CoordinatorStats as CoordinatorStats
from ._stats import LatencySummary as LatencySummary
from ._version import __version__ as __version__
from .backends.base import LockInfo as LockInfo

__all__ = (
    "BackendError",
    "Backoff",
    "Coordinator",
    "CoordinatorClosed",
    "CoordinatorStats",
    "Election",
    "LatencySummary",
    "Leadership",
    "LeadershipLost",
    "Lease",
    "Lock",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockNotOwned",
    "LockTimeout",
    "QuorumError",
    "ReadWriteLock",
    "Term",
    "__version__",
    "connect",
)

# A library logs, the application decides where to: without a handler of its own, a record
# of a caught error would reach stderr through logging's last-resort handler.
_logging.getLogger("asynclock").addHandler(_logging.NullHandler())

# Reprs and tracebacks name the public module, not the private one that defines them.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("asynclock."):
        _obj.__module__ = "asynclock"
del _name, _obj
