"""Test support: real servers for pytest, and a manual clock for the memory backend.

The pytest plugin (``asynclock.testing.plugin``, loaded automatically once asynclock is
installed) provides the fixtures ``asynclock_redis_server``, ``asynclock_redis_url``,
``asynclock_valkey_factory``, ``asynclock_redlock_servers``, ``asynclock_redlock_urls``,
``asynclock_sentinel`` (Redis behind Sentinel), ``asynclock_cluster`` (Redis Cluster),
``asynclock_postgres_server``, ``asynclock_postgres_dsn`` and ``asynclock_postgres_factory``.
The classes and functions behind them are here for tests that start servers themselves,
with the fault-injecting proxy (:mod:`.proxy`) and the history checker (:mod:`.history`).
"""

from typing import TYPE_CHECKING, Any

from ._clock import ManualClock as ManualClock
from ._servers import ContainerServer as ContainerServer
from ._servers import ExternalServer as ExternalServer
from ._servers import PostgresFactory as PostgresFactory
from ._servers import PostgresServer as PostgresServer
from ._servers import ServerProcess as ServerProcess
from ._servers import ServerStartError as ServerStartError
from ._servers import ServerUnavailable as ServerUnavailable
from ._servers import ValkeyFactory as ValkeyFactory
from ._servers import ValkeyServer as ValkeyServer
from ._servers import find_postgres_bindir as find_postgres_bindir
from ._servers import find_valkey_binary as find_valkey_binary
from ._servers import postgres_server as postgres_server
from ._servers import redis_server as redis_server
from ._servers import start_postgres as start_postgres
from ._servers import start_valkey as start_valkey
from ._topology import ClusterNode as ClusterNode
from ._topology import ClusterSetup as ClusterSetup
from ._topology import SentinelServer as SentinelServer
from ._topology import SentinelSetup as SentinelSetup
from ._topology import TopologyTimeout as TopologyTimeout
from ._topology import start_cluster as start_cluster
from ._topology import start_sentinel as start_sentinel
from .history import Ack as Ack
from .history import Entry as Entry
from .history import FencedLog as FencedLog
from .history import FenceRejected as FenceRejected
from .history import Report as Report
from .history import Violation as Violation
from .history import check as check_history

if TYPE_CHECKING:
    from .proxy import FaultProxy as FaultProxy
    from .proxy import ProxyProcess as ProxyProcess
    from .proxy import ProxyStats as ProxyStats

__all__ = (
    "Ack",
    "ClusterNode",
    "ClusterSetup",
    "ContainerServer",
    "Entry",
    "ExternalServer",
    "FaultProxy",
    "FenceRejected",
    "FencedLog",
    "ManualClock",
    "PostgresFactory",
    "PostgresServer",
    "ProxyProcess",
    "ProxyStats",
    "Report",
    "SentinelServer",
    "SentinelSetup",
    "ServerProcess",
    "ServerStartError",
    "ServerUnavailable",
    "TopologyTimeout",
    "ValkeyFactory",
    "ValkeyServer",
    "Violation",
    "check_history",
    "find_postgres_bindir",
    "find_valkey_binary",
    "postgres_server",
    "redis_server",
    "start_cluster",
    "start_postgres",
    "start_sentinel",
    "start_valkey",
)


def __getattr__(name: str) -> Any:
    # The proxy is imported on first use, not with the package: `python -m
    # asynclock.testing.proxy` would otherwise find it imported before it runs as __main__.
    if name in ("FaultProxy", "ProxyProcess", "ProxyStats"):
        from . import proxy  # noqa: PLC0415

        return getattr(proxy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
