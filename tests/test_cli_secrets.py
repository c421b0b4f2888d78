"""The ``asynclock`` command never prints a password, however the URL is written.

Raw ``#``, ``?`` and ``/`` in a password end the host part in URL grammar, so a parser
that trusts the grammar echoes half a password back; keyword DSNs carry
``password=…`` in the clear. Each case runs the command as a subprocess.
"""

from __future__ import annotations

import pytest

from benchmarks.suite._env import Scrubber, redact

from .test_cli import EXIT_UNREACHABLE, EXIT_USAGE, cli

SECRET = "hunt{}er22-x"  # noqa: S105 - a made-up password the output must not show


COMMANDS = {
    "inspect-redis": ("redis", ("inspect", "x", "--url")),
    "inspect-postgres": ("postgresql", ("inspect", "x", "--url")),
    "bench-pg": ("postgresql", ("bench", "--quick", "--no-peers", "--pg")),
}


@pytest.mark.parametrize("char", ["#", "?", "/"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_raw_special_character_in_the_password(char: str, command: str) -> None:
    """A usage error that says what to encode, and no part of the password."""
    secret = SECRET.format(char)
    scheme, args = COMMANDS[command]
    url = f"{scheme}://app:{secret}@127.0.0.1:1/0"
    done = cli(*args, url)
    assert done.returncode == EXIT_USAGE, done.stderr
    text = done.stdout + done.stderr
    for part in secret.split(char):
        assert part not in text
    assert "percent-encoded" in done.stderr


@pytest.mark.parametrize("more", ["", " application_name=a://b"])
def test_keyword_dsn_is_redacted(more: str) -> None:
    """Also with ``://`` in a value: still a keyword DSN, not a URL."""
    dsn = f"host=127.0.0.1 port=1 password=hunter22-x user=app{more}"
    done = cli("inspect", "x", "--url", dsn)
    assert done.returncode in (EXIT_USAGE, EXIT_UNREACHABLE)
    assert "hunter22-x" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunt#er22@h:6379/0",
        "postgresql://app:s3cr/t?PW@h1:5432,h2:5432/db",
        "redis://u:p%23ssw0rd@h/0?password=qqqzzz",
        "host=h password='a b hunter' user=app",
        "host=h PASSWORD=hunter22 user=app",
        "host=h password=hunter22 application_name=a://b user=app",
    ],
)
def test_redact_and_scrub(url: str) -> None:
    """Neither the redacted URL nor scrubbed text holds any part of the password."""
    secrets = ("hunt", "er22", "s3cr", "PW@", "p%23ssw0rd", "p#ssw0rd", "qqqzzz", "a b hunter")
    shown = redact(url)
    scrubbed = Scrubber([url])(f"failed: {url}")
    for secret in secrets:
        assert secret not in shown, shown
        assert secret not in scrubbed, scrubbed
    assert "***" in shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("memory://", "memory://"),
        ("unix:///tmp/v.sock?db=0", "unix:///tmp/v.sock?db=0"),
        ("unix:///tmp/v.sock?password=qqqzzz", "unix:///tmp/v.sock?password=***"),
        ("redis://:qqqzzz@h:1/0?x=1#f", "redis://:***@h:1/0?x=1#f"),
        (
            "postgresql://h/db?password=qqqzzz&sslmode=require",
            "postgresql://h/db?password=***&sslmode=require",
        ),
    ],
)
def test_redact_keeps_the_rest_of_the_url(url: str, shown: str) -> None:
    """Only the password changes: an empty host keeps its ``//``, and a query with no
    secret in it stays as written."""
    assert redact(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app@127.0.0.1:1/db?sslpassword=qqqzzz-1",
        "rediss://app@127.0.0.1:1/0?ssl_password=qqqzzz-1",
        "host=127.0.0.1 port=1 user=app sslpassword=qqqzzz-1",
    ],
)
def test_tls_key_passwords_are_secrets(url: str) -> None:
    """The drivers read a TLS key's password from ``sslpassword`` (asyncpg) and
    ``ssl_password`` (redis-py): secrets too, in the URL query and in a keyword DSN."""
    assert "qqqzzz" not in redact(url)
    assert "qqqzzz" not in Scrubber([url])(f"failed: {url}")
    done = cli("inspect", "x", "--url", url)
    assert done.returncode in (EXIT_USAGE, EXIT_UNREACHABLE), done.stderr
    assert "qqqzzz" not in done.stdout + done.stderr


@pytest.mark.parametrize("option", ["protocol=9", "ssl_cert_reqs=bogus"])
def test_a_bad_redis_option_is_a_usage_error(option: str) -> None:
    """A value redis-py refuses is one line and exit code 2, not a traceback."""
    done = cli("inspect", "x", "--url", f"rediss://app:hunter22-x@127.0.0.1:1/0?{option}")
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stderr
    assert "hunter22-x" not in done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
