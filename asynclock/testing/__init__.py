"""In-process helpers for testing code that uses asynclock.

- :class:`ManualClock`: a clock moved by hand, for the memory backend
  (``Coordinator(MemoryBackend(clock=clock))``), so TTLs, renewals and retries run
  without waiting.
- :func:`check_backend`: the backend contract kit, for implementers of a backend
  (:mod:`.contract`).

Real servers for tests (the pytest fixtures, server launchers, the fault-injecting proxy
and the history checker) are the separate distribution ``pytest-asynclock`` (import
``pytest_asynclock``).
"""

from __future__ import annotations

from typing import Any

from .clock import ManualClock as ManualClock
from .contract import ContractViolation as ContractViolation
from .contract import check_backend as check_backend

__all__ = ("ContractViolation", "ManualClock", "check_backend")

# Names this package had before the real-server tooling moved to pytest-asynclock.
_MOVED = frozenset(
    (
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
)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        raise AttributeError(
            f"asynclock.testing.{name} moved to the pytest-asynclock distribution: "
            f"pip install pytest-asynclock, then: from pytest_asynclock import {name}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
