"""Backends: where locks live. ``Backend`` is the interface a new backend implements.

``MemoryBackend`` needs nothing more; ``RedisBackend`` and ``RedlockBackend`` (redis-py)
and ``PostgresBackend`` (asyncpg) are imported, with their driver, on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import Attempt as Attempt
from .base import Backend as Backend
from .base import Claim as Claim
from .base import GiveBack as GiveBack
from .base import Interrupted as Interrupted
from .base import Kind as Kind
from .base import LockInfo as LockInfo
from .base import Wakeups as Wakeups
from .memory import MemoryBackend as MemoryBackend

if TYPE_CHECKING:
    from .postgres import PostgresBackend as PostgresBackend
    from .redis import RedisBackend as RedisBackend
    from .redlock import RedlockBackend as RedlockBackend

__all__ = (
    "Attempt",
    "Backend",
    "Claim",
    "GiveBack",
    "Interrupted",
    "Kind",
    "LockInfo",
    "MemoryBackend",
    "PostgresBackend",
    "RedisBackend",
    "RedlockBackend",
    "Wakeups",
)

# The backends whose modules import a driver: loaded by the first access to their name.
_LAZY = {
    "PostgresBackend": ".postgres",
    "RedisBackend": ".redis",
    "RedlockBackend": ".redlock",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
