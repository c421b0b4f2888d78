"""URL checks and password redaction for the ``asynclock`` command (and the benchmark
suite of the repository, which shares them): a password never reaches the terminal, a
JSON report or a chart."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

__all__ = (
    "POSTGRES_SCHEMES",
    "REDIS_SCHEMES",
    "Scrubber",
    "Unreachable",
    "UsageError",
    "check_url",
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


class UsageError(ValueError):
    """A URL or option the command cannot use (exit code 2)."""


class Unreachable(RuntimeError):
    """A server did not answer (exit code 1)."""


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
