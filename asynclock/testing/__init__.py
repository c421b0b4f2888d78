"""Test support: real servers for pytest, and a manual clock for the memory backend.

The pytest plugin (``asynclock.testing.plugin``, loaded automatically once asynclock is
installed) provides the fixtures ``asynclock_redis_server``, ``asynclock_redis_url``,
``asynclock_valkey_factory``, ``asynclock_postgres_server``, ``asynclock_postgres_dsn`` and
``asynclock_postgres_factory``. The classes and functions behind them are here for tests
that start servers themselves.
"""

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

__all__ = (
    "ContainerServer",
    "ExternalServer",
    "ManualClock",
    "PostgresFactory",
    "PostgresServer",
    "ServerProcess",
    "ServerStartError",
    "ServerUnavailable",
    "ValkeyFactory",
    "ValkeyServer",
    "find_postgres_bindir",
    "find_valkey_binary",
    "postgres_server",
    "redis_server",
    "start_postgres",
    "start_valkey",
)
