"""Backends: where locks live. ``Backend`` is the interface a new backend implements."""

from .base import Attempt as Attempt
from .base import Backend as Backend
from .base import Claim as Claim
from .base import LockInfo as LockInfo
from .memory import MemoryBackend as MemoryBackend
from .postgres import PostgresBackend as PostgresBackend
from .redis import RedisBackend as RedisBackend
from .redlock import RedlockBackend as RedlockBackend

__all__ = (
    "Attempt",
    "Backend",
    "Claim",
    "LockInfo",
    "MemoryBackend",
    "PostgresBackend",
    "RedisBackend",
    "RedlockBackend",
)
