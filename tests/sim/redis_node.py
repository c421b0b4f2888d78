"""A simulated Redis node: the commands asynclock sends, Lua scripts run by Lua 5.1.

The node keeps strings, hashes and sorted sets with millisecond expiry on its own
drifting clock (:class:`~tests.sim.loop.DriftClock`), and runs scripts the way Redis
does: ``SCRIPT LOAD`` compiles the source as the body of a function in an embedded Lua
5.1 runtime (``lupa.lua51``: Redis's Lua), ``EVALSHA`` sets ``KEYS`` and ``ARGV`` and
calls it, and ``redis.call``/``redis.pcall`` come back here with Redis's conversions
(integer replies to numbers, nil to ``false``, status replies to ``{ok=...}``, errors to
``{err=...}``; a Lua number passed as an argument is written as an integer when it is
one; a script's number result is truncated to an integer, ``true`` is 1, ``false`` is
nil). tests/test_sim.py holds the node to a real server's answers.

Commands: the handshake ones (``HELLO``, ``CLIENT``, ``SELECT``, ``PING``,
``INFO server`` with its ``run_id``), ``SCRIPT LOAD``/``EVALSHA``/``EVAL``, and inside
scripts ``TIME``, ``GET``, ``SET`` (``NX``/``XX``/``PX``/``EX``), ``DEL``, ``EXISTS``,
``INCR``, ``PEXPIRE``, ``PTTL``, ``HSET``/``HGET``/``HDEL``, ``ZADD`` (``NX``/``XX``),
``ZRANGE`` (by index or ``BYSCORE``, ``WITHSCORES``), ``ZREM``, ``ZSCORE``, ``ZCARD`` and
``PUBLISH``. Pub/sub (``SUBSCRIBE``/``UNSUBSCRIBE``) belongs to the connection, see
:mod:`tests.sim.wire`. A restart loses everything (no persistence), scripts included.

Replies are Python values tagged as Redis types: :class:`Status`, :class:`Error`,
``int``, ``str`` (bulk), ``None`` (nil) and lists; :func:`encode` writes them as RESP2.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lupa import lua51

from .loop import DriftClock

__all__ = ("Error", "RedisNode", "Status", "encode")


@dataclass(frozen=True)
class Status:
    """A status reply (``+OK``)."""

    text: str


@dataclass(frozen=True)
class Error:
    """An error reply (``-ERR ...``)."""

    text: str


class _Hash(dict[str, str]):
    """A hash value."""


class _ZSet(dict[str, float]):
    """A sorted set value: member -> score."""

    def ordered(self) -> list[tuple[str, float]]:
        return sorted(self.items(), key=lambda item: (item[1], item[0].encode()))


_WRONGTYPE = Error("WRONGTYPE Operation against a key holding the wrong kind of value")
_NOT_INT = Error("ERR value is not an integer or out of range")
_NOT_FLOAT = Error("ERR value is not a valid float")
_SYNTAX = Error("ERR syntax error")
_OK = Status("OK")


class _Fail(Exception):
    """A command's error reply, raised inside its implementation."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.text)
        self.error = error


def encode(reply: Any) -> bytes:  # noqa: PLR0911 - one branch per RESP type
    """RESP2 bytes of a reply."""
    if isinstance(reply, Status):
        return b"+" + reply.text.encode() + b"\r\n"
    if isinstance(reply, Error):
        return b"-" + reply.text.encode() + b"\r\n"
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, bool):
        return b":1\r\n" if reply else b"$-1\r\n"
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if isinstance(reply, str):
        data = reply.encode()
        return b"$%d\r\n%s\r\n" % (len(data), data)
    if isinstance(reply, bytes):
        return b"$%d\r\n%s\r\n" % (len(reply), reply)
    if isinstance(reply, list):
        return b"*%d\r\n" % len(reply) + b"".join(encode(item) for item in reply)
    raise TypeError(f"cannot encode {reply!r}")


def _int(text: str) -> int:
    if text.strip() != text or not text:
        raise _Fail(_NOT_INT)
    try:
        return int(text)
    except ValueError:
        raise _Fail(_NOT_INT) from None


def _float(text: str) -> float:
    low = text.lower()
    if low in ("-inf", "+inf", "inf"):
        return -math.inf if low == "-inf" else math.inf
    try:
        value = float(text)
    except ValueError:
        raise _Fail(_NOT_FLOAT) from None
    if math.isnan(value):
        raise _Fail(_NOT_FLOAT)
    return value


def _score_text(score: float) -> str:
    """A score as Redis prints it: integers without a fraction, else the shortest form."""
    if math.isinf(score):
        return "inf" if score > 0 else "-inf"
    if score == int(score) and abs(score) < 1e17:
        return str(int(score))
    return repr(score)


def _lua_arg(value: Any) -> str:
    """A ``redis.call`` argument as Redis (>= 7) sees it: a number with an integer value
    as that integer, any other number in its shortest exact form."""
    if isinstance(value, bool):
        raise _Fail(Error("ERR Lua redis lib command arguments must be strings or integers"))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**63:
            return str(int(value))
        return repr(value)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, str):
        return value
    raise _Fail(Error("ERR Lua redis lib command arguments must be strings or integers"))


_PRELUDE = """
local py_call, py_sha1 = ...
redis = {}
function redis.call(...)
  local ok, value = py_call(true, ...)
  if not ok then
    error(value, 0)
  end
  return value
end
function redis.pcall(...)
  local ok, value = py_call(false, ...)
  if not ok then
    return {err = value}
  end
  return value
end
function redis.sha1hex(text)
  return py_sha1(text)
end
function redis.error_reply(text)
  return {err = text}
end
function redis.status_reply(text)
  return {ok = text}
end
function redis.log() end
redis.LOG_DEBUG, redis.LOG_VERBOSE, redis.LOG_NOTICE, redis.LOG_WARNING = 0, 1, 2, 3
"""


class RedisNode:
    """One Redis server process on its own clock; ``restart()`` empties it.

    ``publish(channel, message)`` is called for each ``PUBLISH`` (the wire delivers it to
    the subscribed connections) and returns how many received it.
    """

    def __init__(self, index: int, clock: DriftClock, run_ids: Callable[[], str]) -> None:
        self.index = index
        self.name = f"n{index}"
        self.clock = clock
        self._run_ids = run_ids
        self.publish: Callable[[str, str], int] = lambda _c, _m: 0
        self.up = True
        self.restarts = 0
        #: Counts the commands run (what a reader of the data may cache on).
        self.version = 0
        self._start()

    def _start(self) -> None:
        self.run_id = self._run_ids()
        self.version += 1
        self.data: dict[str, str | _Hash | _ZSet] = {}
        self.expires: dict[str, int] = {}  # key -> ms of node time
        self.scripts: dict[str, Any] = {}  # sha -> compiled Lua function
        self.sources: dict[str, str] = {}  # sha -> source
        self._lua = lua51.LuaRuntime(unpack_returned_tuples=True)
        self._lua.execute(_PRELUDE, self._from_lua, _sha1)
        self._frozen: int | None = None  # ms: time stands still inside a script
        self._raised: list[str] = []  # the error of a redis.call ending the script, its command

    def crash(self) -> None:
        """The process dies: every key and script is gone (no persistence)."""
        self.up = False
        self.restarts += 1

    def restart(self) -> None:
        """The process starts again, empty, with a new ``run_id``."""
        self._start()
        self.up = True

    # -- time ---------------------------------------------------------------------------

    def now_us(self) -> int:
        """The node's clock in microseconds (what ``TIME`` answers)."""
        return math.floor(self.clock.now() * 1_000_000)

    def mstime(self) -> int:
        """The node's clock in whole milliseconds (what expiry is counted in)."""
        if self._frozen is not None:
            return self._frozen
        return self.now_us() // 1000

    def real_ms(self, ms: float) -> float:
        """Virtual (real) time at which this node's clock reads ``ms``."""
        return self.clock.real(ms / 1000)

    def expired_at(self, key: str) -> float | None:
        """Virtual time at which ``key`` stops existing (None: no expiry or no key)."""
        when = self.expires.get(key)
        if when is None or key not in self.data:
            return None
        # Redis treats a key as expired once mstime() > when: from when + 1 ms on.
        return self.real_ms(when + 1)

    def _live(self, key: str) -> bool:
        when = self.expires.get(key)
        if when is not None and self.mstime() > when:
            del self.data[key]
            del self.expires[key]
            return False
        return key in self.data

    def peek(self, key: str) -> str | _Hash | _ZSet | None:
        """A key's value if it exists now (no side effects beyond lazy expiry)."""
        return self.data[key] if self._live(key) else None

    def peek_str(self, key: str) -> str | None:
        """A string key's value if it exists now."""
        value = self.peek(key)
        return value if isinstance(value, str) else None

    def peek_hash(self, key: str) -> dict[str, str]:
        """A hash key's fields (empty if none)."""
        value = self.peek(key)
        return value if isinstance(value, _Hash) else {}

    def peek_zset(self, key: str) -> dict[str, float]:
        """A sorted set key's members and scores (empty if none)."""
        value = self.peek(key)
        return value if isinstance(value, _ZSet) else {}

    # -- commands ------------------------------------------------------------------------

    def execute(self, args: list[str]) -> Any:
        """Run one command from a client; the reply (an :class:`Error` on failure)."""
        self.version += 1
        try:
            return self._command(args, scripted=False)
        except _Fail as fail:
            return fail.error

    def _command(self, args: list[str], *, scripted: bool) -> Any:  # noqa: PLR0911
        if not args:
            raise _Fail(Error("ERR empty command"))
        name = args[0].upper()
        rest = args[1:]
        if not scripted:
            if name == "EVALSHA":
                return self._evalsha(rest)
            if name == "EVAL":
                sha = self._load(rest[0]) if rest else ""
                return self._evalsha([sha, *rest[1:]])
            if name == "SCRIPT":
                if rest and rest[0].upper() == "LOAD" and len(rest) == 2:
                    return self._load(rest[1])
                if rest and rest[0].upper() == "FLUSH":
                    self.scripts.clear()
                    self.sources.clear()
                    return _OK
                raise _Fail(_SYNTAX)
            if name == "INFO":
                return f"# Server\r\nredis_version:7.4.0\r\nrun_id:{self.run_id}\r\n"
            if name in ("CLIENT", "SELECT", "AUTH"):
                return _OK
            if name == "HELLO":
                raise _Fail(Error("NOPROTO unsupported protocol version"))
            if name == "PING":
                return Status("PONG")
        handler = _COMMANDS.get(name)
        if handler is None:
            raise _Fail(Error(f"ERR unknown command '{args[0]}'"))
        return handler(self, rest)

    def _load(self, source: str) -> str:
        sha = _sha1(source)
        if sha not in self.scripts:
            try:
                self.scripts[sha] = self._lua.execute(f"return function()\n{source}\nend")
            except lua51.LuaError as exc:
                raise _Fail(Error(f"ERR Error compiling script: {exc}")) from None
            self.sources[sha] = source
        return sha

    def _evalsha(self, rest: list[str]) -> Any:
        if len(rest) < 2:
            raise _Fail(Error("ERR wrong number of arguments for 'evalsha' command"))
        fn = self.scripts.get(rest[0].lower())
        if fn is None:
            raise _Fail(Error("NOSCRIPT No matching script. Please use EVAL."))
        numkeys = _int(rest[1])
        if numkeys < 0 or numkeys > len(rest) - 2:
            raise _Fail(Error("ERR Number of keys can't be greater than number of args"))
        keys, argv = rest[2 : 2 + numkeys], rest[2 + numkeys :]
        lua = self._lua
        lua_globals = lua.globals()
        lua_globals.KEYS = lua.table_from(keys)
        lua_globals.ARGV = lua.table_from(argv)
        self._frozen = self.mstime()
        self._raised.clear()
        try:
            result = fn()
        except lua51.LuaError as exc:
            # A failed redis.call ends the script with that command's error.
            if self._raised:
                error, command = self._raised
                return Error(f"{error} script: {command}")
            return Error(f"ERR user_script: {exc}")
        finally:
            self._frozen = None
        return self._to_reply(result)

    def _to_reply(self, value: Any) -> Any:  # noqa: PLR0911 - one branch per Lua type
        """A Lua value returned by a script, as Redis turns it into a reply."""
        if value is None or value is False:
            return None
        if value is True:
            return 1
        if isinstance(value, int | float):
            return int(value)
        if isinstance(value, str):
            return value
        if lua51.lua_type(value) == "table":
            err = value["err"]
            if err is not None:
                return Error(str(err))
            ok = value["ok"]
            if ok is not None:
                return Status(str(ok))
            out = []
            i = 1
            while (item := value[i]) is not None:
                out.append(self._to_reply(item))
                i += 1
            return out
        return None

    def _from_lua(self, raising: bool, *args: Any) -> tuple[bool, Any]:
        """``redis.call`` (``raising``) or ``redis.pcall`` from a script: (True, Lua
        value) or (False, error text)."""
        try:
            reply = self._command([_lua_arg(a) for a in args], scripted=True)
        except _Fail as fail:
            if raising:
                self._raised[:] = [fail.error.text, str(args[0] if args else "")]
            return False, fail.error.text
        return True, self._to_lua(reply)

    def _to_lua(self, reply: Any) -> Any:
        if reply is None:
            return False
        if isinstance(reply, Status):
            return self._lua.table_from({"ok": reply.text})
        if isinstance(reply, Error):
            return self._lua.table_from({"err": reply.text})
        if isinstance(reply, list):
            return self._lua.table_from([self._to_lua(item) for item in reply])
        return reply

    # -- the data model -------------------------------------------------------------------

    def _get(self, key: str, kind: type) -> Any:
        value = self.peek(key)
        if value is not None and type(value) is not kind:
            raise _Fail(_WRONGTYPE)
        return value

    def _delete(self, key: str) -> bool:
        existed = self._live(key)
        self.data.pop(key, None)
        self.expires.pop(key, None)
        return existed

    def _drop_if_empty(self, key: str) -> None:
        value = self.data.get(key)
        if isinstance(value, dict) and not value:
            self._delete(key)

    def cmd_time(self, _rest: list[str]) -> Any:
        us = self.now_us()
        return [str(us // 1_000_000), str(us % 1_000_000)]

    def cmd_get(self, rest: list[str]) -> Any:
        return self._get(rest[0], str)

    def cmd_set(self, rest: list[str]) -> Any:
        key, value, options = rest[0], rest[1], [o.upper() for o in rest[2:]]
        raw = rest[2:]
        nx = xx = False
        expire_ms: int | None = None
        i = 0
        while i < len(options):
            option = options[i]
            if option == "NX":
                nx = True
            elif option == "XX":
                xx = True
            elif option in ("PX", "EX") and i + 1 < len(options):
                amount = _int(raw[i + 1])
                if amount <= 0:
                    raise _Fail(Error("ERR invalid expire time in 'set' command"))
                expire_ms = amount if option == "PX" else amount * 1000
                i += 1
            else:
                raise _Fail(_SYNTAX)
            i += 1
        exists = self._live(key)
        if (nx and exists) or (xx and not exists):
            return None
        self.data[key] = value
        if expire_ms is None:
            self.expires.pop(key, None)
        else:
            self.expires[key] = self.mstime() + expire_ms
        return _OK

    def cmd_del(self, rest: list[str]) -> Any:
        return sum(self._delete(key) for key in rest)

    def cmd_exists(self, rest: list[str]) -> Any:
        return sum(self._live(key) for key in rest)

    def cmd_incr(self, rest: list[str]) -> Any:
        current = self._get(rest[0], str)
        value = _int(current if current is not None else "0") + 1
        self.data[rest[0]] = str(value)
        return value

    def cmd_pexpire(self, rest: list[str]) -> Any:
        key, amount = rest[0], _int(rest[1])
        if not self._live(key):
            return 0
        if amount <= 0:
            self._delete(key)
        else:
            self.expires[key] = self.mstime() + amount
        return 1

    def cmd_pttl(self, rest: list[str]) -> Any:
        key = rest[0]
        if not self._live(key):
            return -2
        when = self.expires.get(key)
        return -1 if when is None else max(when - self.mstime(), 0)

    def cmd_hset(self, rest: list[str]) -> Any:
        if len(rest) < 3 or len(rest) % 2 == 0:
            raise _Fail(Error("ERR wrong number of arguments for 'hset' command"))
        value = self._get(rest[0], _Hash)
        if value is None:
            value = self.data[rest[0]] = _Hash()
        added = 0
        for field, item in zip(rest[1::2], rest[2::2], strict=True):
            added += field not in value
            value[field] = item
        return added

    def cmd_hget(self, rest: list[str]) -> Any:
        value = self._get(rest[0], _Hash)
        return None if value is None else value.get(rest[1])

    def cmd_hdel(self, rest: list[str]) -> Any:
        value = self._get(rest[0], _Hash)
        if value is None:
            return 0
        removed = sum(value.pop(field, None) is not None for field in rest[1:])
        self._drop_if_empty(rest[0])
        return removed

    def cmd_zadd(self, rest: list[str]) -> Any:
        key, i = rest[0], 1
        nx = xx = False
        while i < len(rest) and rest[i].upper() in ("NX", "XX"):
            nx, xx = nx or rest[i].upper() == "NX", xx or rest[i].upper() == "XX"
            i += 1
        pairs = rest[i:]
        if not pairs or len(pairs) % 2:
            raise _Fail(_SYNTAX)
        if nx and xx:
            raise _Fail(Error("ERR XX and NX options at the same time are not compatible"))
        scores = [(_float(s), m) for s, m in zip(pairs[::2], pairs[1::2], strict=True)]
        value = self._get(key, _ZSet)
        if value is None:
            if xx:
                return 0
            value = self.data[key] = _ZSet()
        added = 0
        for score, member in scores:
            if member in value:
                if not nx:
                    value[member] = score
            elif not xx:
                value[member] = score
                added += 1
        self._drop_if_empty(key)
        return added

    def cmd_zrange(self, rest: list[str]) -> Any:
        key, low, high = rest[0], rest[1], rest[2]
        flags = [f.upper() for f in rest[3:]]
        value = self._get(key, _ZSet)
        items = [] if value is None else value.ordered()
        if "BYSCORE" in flags:
            lo, hi = _float(low), _float(high)
            chosen = [item for item in items if lo <= item[1] <= hi]
        else:
            start, stop, n = _int(low), _int(high), len(items)
            start = max(start + n if start < 0 else start, 0)
            stop = stop + n if stop < 0 else stop
            chosen = items[start : stop + 1] if start <= stop else []
        if "WITHSCORES" in flags:
            return [x for member, score in chosen for x in (member, _score_text(score))]
        return [member for member, _ in chosen]

    def cmd_zrem(self, rest: list[str]) -> Any:
        value = self._get(rest[0], _ZSet)
        if value is None:
            return 0
        removed = sum(value.pop(member, None) is not None for member in rest[1:])
        self._drop_if_empty(rest[0])
        return removed

    def cmd_zscore(self, rest: list[str]) -> Any:
        value = self._get(rest[0], _ZSet)
        score = None if value is None else value.get(rest[1])
        return None if score is None else _score_text(score)

    def cmd_zcard(self, rest: list[str]) -> Any:
        value = self._get(rest[0], _ZSet)
        return 0 if value is None else len(value)

    def cmd_publish(self, rest: list[str]) -> Any:
        return self.publish(rest[0], rest[1])


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # noqa: S324 - Redis names scripts by SHA1


_COMMANDS: dict[str, Callable[[RedisNode, list[str]], Any]] = {
    "TIME": RedisNode.cmd_time,
    "GET": RedisNode.cmd_get,
    "SET": RedisNode.cmd_set,
    "DEL": RedisNode.cmd_del,
    "EXISTS": RedisNode.cmd_exists,
    "INCR": RedisNode.cmd_incr,
    "PEXPIRE": RedisNode.cmd_pexpire,
    "PTTL": RedisNode.cmd_pttl,
    "HSET": RedisNode.cmd_hset,
    "HGET": RedisNode.cmd_hget,
    "HDEL": RedisNode.cmd_hdel,
    "ZADD": RedisNode.cmd_zadd,
    "ZRANGE": RedisNode.cmd_zrange,
    "ZREM": RedisNode.cmd_zrem,
    "ZSCORE": RedisNode.cmd_zscore,
    "ZCARD": RedisNode.cmd_zcard,
    "PUBLISH": RedisNode.cmd_publish,
    "SPUBLISH": RedisNode.cmd_publish,
}
