"""The Redis/Valkey backend: one node, a Sentinel-managed master, or a Redis Cluster.

``RedisBackend`` is the backend; the other names are the pieces it is built from that
tests, Redlock and tools use.
"""

from __future__ import annotations

from .backend import LINGER as LINGER
from .backend import QUEUE_MARGIN_MS as QUEUE_MARGIN_MS
from .backend import RELEASED_MARGIN_MS as RELEASED_MARGIN_MS
from .backend import Call as Call
from .backend import Keys as Keys
from .backend import RedisBackend as RedisBackend
from .backend import backend_options as backend_options
from .backend import client_from_url as client_from_url
from .backend import describe_pool as describe_pool

__all__ = (
    "LINGER",
    "QUEUE_MARGIN_MS",
    "RELEASED_MARGIN_MS",
    "Call",
    "Keys",
    "RedisBackend",
    "backend_options",
    "client_from_url",
    "describe_pool",
)
