"""The Redis/Valkey backend: one node, a Sentinel-managed master, or a Redis Cluster.

One module per layer, each depending only on those listed before it:

- :mod:`.scripts`: the Lua scripts, one atomic step each;
- :mod:`.keys`: the key schema (the keys and channels of a name, one hash tag);
- :mod:`.calls`: which script, keys and arguments each operation sends (no I/O);
- :mod:`.clients`: redis-py clients from URLs (one node, Sentinel, Cluster);
- :mod:`.pipe`: the pipelined connection (hiredis, one write per request);
- :mod:`.transport`: a node's link, and script calls sent over it;
- :mod:`.pubsub`: the pub/sub client, waiters and listeners;
- :mod:`.backend`: :class:`RedisBackend`, the Backend contract composed of the above.

This package re-exports what other parts of asynclock and its tests use.
"""

from __future__ import annotations

from .backend import RedisBackend as RedisBackend
from .calls import QUEUE_MARGIN_MS as QUEUE_MARGIN_MS
from .calls import RELEASED_MARGIN_MS as RELEASED_MARGIN_MS
from .calls import Call as Call
from .clients import backend_options as backend_options
from .clients import client_from_url as client_from_url
from .clients import describe_pool as describe_pool
from .keys import Keys as Keys
from .pubsub import LINGER as LINGER

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
