"""Real servers for tests of code that uses asynclock: a pytest plugin and what is behind it.

Installing ``pytest-asynclock`` registers the plugin (:mod:`pytest_asynclock.plugin`),
which provides the fixtures ``asynclock_redis_server``, ``asynclock_redis_url``,
``asynclock_valkey_factory``, ``asynclock_redlock_servers``, ``asynclock_redlock_urls``,
``asynclock_sentinel`` (Redis behind Sentinel), ``asynclock_cluster`` (Redis Cluster),
``asynclock_postgres_server``, ``asynclock_postgres_dsn`` and
``asynclock_postgres_factory``. The classes and functions behind them are here for tests
that start servers themselves (:mod:`.servers`, :mod:`.topology`), with the
fault-injecting proxy (:mod:`.proxy`) and the history checker (:mod:`.history`).

Every name is imported on first use: loading the plugin costs pytest a few standard
library modules, and neither redis-py nor asyncpg is imported until a test needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .history import Ack as Ack
    from .history import Entry as Entry
    from .history import FencedLog as FencedLog
    from .history import FenceRejected as FenceRejected
    from .history import Report as Report
    from .history import Violation as Violation
    from .history import check as check_history
    from .proxy import FaultProxy as FaultProxy
    from .proxy import ProxyProcess as ProxyProcess
    from .proxy import ProxyStats as ProxyStats
    from .servers import ContainerServer as ContainerServer
    from .servers import ExternalServer as ExternalServer
    from .servers import PostgresFactory as PostgresFactory
    from .servers import PostgresServer as PostgresServer
    from .servers import ServerProcess as ServerProcess
    from .servers import ServerStartError as ServerStartError
    from .servers import ServerUnavailable as ServerUnavailable
    from .servers import ValkeyFactory as ValkeyFactory
    from .servers import ValkeyServer as ValkeyServer
    from .servers import find_postgres_bindir as find_postgres_bindir
    from .servers import find_valkey_binary as find_valkey_binary
    from .servers import postgres_server as postgres_server
    from .servers import redis_server as redis_server
    from .servers import start_postgres as start_postgres
    from .servers import start_valkey as start_valkey
    from .topology import ClusterNode as ClusterNode
    from .topology import ClusterSetup as ClusterSetup
    from .topology import SentinelServer as SentinelServer
    from .topology import SentinelSetup as SentinelSetup
    from .topology import TopologyTimeout as TopologyTimeout
    from .topology import start_cluster as start_cluster
    from .topology import start_sentinel as start_sentinel

# public name -> (module, name in it)
_WHERE: dict[str, tuple[str, str]] = {
    "Ack": ("history", "Ack"),
    "ClusterNode": ("topology", "ClusterNode"),
    "ClusterSetup": ("topology", "ClusterSetup"),
    "ContainerServer": ("servers", "ContainerServer"),
    "Entry": ("history", "Entry"),
    "ExternalServer": ("servers", "ExternalServer"),
    "FaultProxy": ("proxy", "FaultProxy"),
    "FenceRejected": ("history", "FenceRejected"),
    "FencedLog": ("history", "FencedLog"),
    "PostgresFactory": ("servers", "PostgresFactory"),
    "PostgresServer": ("servers", "PostgresServer"),
    "ProxyProcess": ("proxy", "ProxyProcess"),
    "ProxyStats": ("proxy", "ProxyStats"),
    "Report": ("history", "Report"),
    "SentinelServer": ("topology", "SentinelServer"),
    "SentinelSetup": ("topology", "SentinelSetup"),
    "ServerProcess": ("servers", "ServerProcess"),
    "ServerStartError": ("servers", "ServerStartError"),
    "ServerUnavailable": ("servers", "ServerUnavailable"),
    "TopologyTimeout": ("topology", "TopologyTimeout"),
    "ValkeyFactory": ("servers", "ValkeyFactory"),
    "ValkeyServer": ("servers", "ValkeyServer"),
    "Violation": ("history", "Violation"),
    "check_history": ("history", "check"),
    "find_postgres_bindir": ("servers", "find_postgres_bindir"),
    "find_valkey_binary": ("servers", "find_valkey_binary"),
    "postgres_server": ("servers", "postgres_server"),
    "redis_server": ("servers", "redis_server"),
    "start_cluster": ("topology", "start_cluster"),
    "start_postgres": ("servers", "start_postgres"),
    "start_sentinel": ("topology", "start_sentinel"),
    "start_valkey": ("servers", "start_valkey"),
}

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
    try:
        module, attribute = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
