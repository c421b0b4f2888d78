"""PostgreSQL DSNs: reading them as asyncpg does, making them readable to it, and showing
them without credentials.

A DSN may hold a password, so nothing here ever puts one in a message: errors and
descriptions name the hosts and the database only.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote, urlsplit

__all__ = ("describe_dsn", "usable_dsn")

# A URL DSN read leniently: credentials up to the last "@" that is followed by a host list
# (no "@", "/", "?" or "#" in it), then the path and query. For passwords with "#", "/",
# "?" or "@" that were not percent-encoded, which a URL parser cuts in the wrong place.
_LENIENT_DSN = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<auth>.*?)@(?P<hosts>[^@/?#]*)(?P<tail>[/?].*)?",
    re.DOTALL,
)


def _host_list_ok(hostspec: str) -> bool:
    """Whether asyncpg can read ``hostspec`` (``h1:5432,[::1]:5433,h3``): ports numeric,
    and no ``@`` (a password's, cut at its own ``@``)."""
    if "@" in hostspec:
        return False
    for item in hostspec.split(","):
        if item.startswith("["):
            _, bracket, rest = item[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                return False
            port = rest[1:]
        else:
            port = item.partition(":")[2]
        if port and not port.isdigit():
            return False
    return True


def _split_dsn(dsn: str) -> tuple[str, str, str, str] | None:
    """``(scheme, credentials, host list, path and query)`` of a URL DSN, read as asyncpg
    reads it (``urllib.parse``, credentials before the first ``@``, several hosts
    separated by commas), else leniently (:data:`_LENIENT_DSN`); None if neither reads
    it. Never raises: the text may hold a password."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        parts = None
    # An "@" after the host list means the grammar cut a password at a raw "/" or "?"
    # ("app:2024/Secret@host": host "app", port 2024): read it leniently instead.
    strict = parts is not None and "@" not in parts.path + parts.query
    if parts is not None and strict and parts.scheme and not parts.fragment:
        auth, at, hostspec = parts.netloc.partition("@")
        if not at:
            auth, hostspec = "", parts.netloc
        if _host_list_ok(hostspec):
            query = f"?{parts.query}" if parts.query else ""
            return parts.scheme, auth, hostspec, parts.path + query
    found = _LENIENT_DSN.fullmatch(dsn)
    if found is None or not _host_list_ok(found["hosts"]):
        return None
    return found["scheme"], found["auth"], found["hosts"], found["tail"] or ""


def describe_dsn(dsn: str) -> str:
    """``hosts/database`` of a DSN, without credentials (for reprs, logs and errors)."""
    split = _split_dsn(dsn)
    if split is None:
        return "(DSN not shown)"
    _, _, hostspec, tail = split
    path = tail.partition("?")[0]
    return f"{hostspec or 'localhost'}{path or '/'}"


def usable_dsn(dsn: str) -> str:
    """``dsn`` as asyncpg will read it: unchanged if it does, else with its credentials
    percent-encoded (a password with an unescaped ``#``, ``/``, ``?`` or ``@``).

    Raises ValueError, naming no credentials, if it is no DSN at all."""
    split = _split_dsn(dsn)
    if split is None:
        raise ValueError(
            f"not a PostgreSQL DSN asyncpg can read: {_redacted(dsn)} (expected "
            "postgresql://user:password@host:port[,host:port...]/database?options)"
        )
    scheme, auth, hostspec, tail = split
    try:
        parts = urlsplit(dsn)
        as_is = parts.netloc.partition("@")[2] == hostspec and not parts.fragment
    except ValueError:
        as_is = False
    if as_is or not auth:
        return dsn
    user, colon, password = auth.partition(":")
    encoded = quote(unquote(user), safe="")
    if colon:
        encoded += ":" + quote(password, safe="")
    return f"{scheme}://{encoded}@{hostspec}{tail}"


def _redacted(dsn: str) -> str:
    """The scheme of a DSN and nothing else of what precedes its host list."""
    scheme = dsn.partition("://")[0] if "://" in dsn else ""
    return f"{scheme}://..." if scheme.isascii() and scheme.isalnum() else "(DSN not shown)"
