"""The key schema: the keys and channels behind a lock name, and their hash tag.

Every key and channel of a name is ``{prefix}:{{name}}...``: they share the hash tag
``{name}``, so that a lock, its fence counter, its queues and its wake-up channels live
in one Redis Cluster slot and one script may touch them all. :mod:`.scripts` lists what
each key holds.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("KeySchema", "Keys", "check_prefix")


def check_prefix(prefix: object) -> str:
    """``prefix`` if it can head keys: a non-empty ``str`` without braces (which would
    move the hash tag). Raises ``TypeError`` or ``ValueError``."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if not prefix or "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must be non-empty and free of '{{' and '}}', got {prefix!r}")
    return prefix


class _Derived:
    """A key of a read-write lock or a semaphore: the lock key and a suffix, made when
    read (a plain lock never pays for these names)."""

    def __init__(self, suffix: str, doc: str) -> None:
        self.suffix = suffix
        self.__doc__ = doc

    def __get__(self, keys: Keys, owner: type[Keys] | None = None) -> str:
        return keys.lock + self.suffix


@dataclass(frozen=True, slots=True)
class Keys:
    """The names behind one lock; they share the hash tag ``{name}``.

    The keys of read-write locks and semaphores are derived from :attr:`lock` when asked
    for: a plain lock never pays for their names.
    """

    lock: str
    fence: str
    channel: str
    queue: str  # exclusive waiters in arrival order (a sorted set)
    due: str  # when each waiter's place in the queue lapses (a hash)

    released = _Derived(
        ":released",
        "Values whose release of the lock (or of a reader) ran lately (a sorted set: SHA1 "
        "of the value -> when that memory ends, ms): a release sent again finds its own.",
    )
    readers = _Derived(":readers", "Readers holding the name (a sorted set: value -> expiry, ms).")
    reader_grants = _Derived(":readers:grants", "Each reader's fence (a hash).")
    reader_queue = _Derived(":readers:queue", "Waiting readers in arrival order.")
    reader_due = _Derived(":readers:due", "When each waiting reader's place lapses.")
    permits = _Derived(
        ":permits", "Holders of the semaphore ``name`` (a sorted set: value -> expiry, ms)."
    )
    permit_fence = _Derived(":permits:fence", "The semaphore's own fence counter.")
    permit_grants = _Derived(":permits:grants", "Each permit holder's fence (a hash).")
    permit_queue = _Derived(":permits:queue", "The semaphore's waiters in arrival order.")
    permit_due = _Derived(":permits:due", "When each waiter's place for a permit lapses.")
    permit_released = _Derived(
        ":permits:released", "Values whose permit's release ran lately (as :attr:`released`)."
    )


class KeySchema:
    """The names of one backend's keys and channels.

    ``prefix`` heads every key; ``inbox`` is the backend's own id, the suffix of the
    channels its queued waiters are woken on (a release names the waiter it wakes and
    publishes to its client's channel alone); ``cluster``: names must keep their hash tag.
    """

    __slots__ = ("_cluster", "_inbox", "_prefix")

    def __init__(self, prefix: str, *, inbox: str, cluster: bool) -> None:
        self._prefix = prefix
        self._inbox = inbox
        self._cluster = cluster

    @property
    def inbox_id(self) -> str:
        """The backend's own id (the scripts' ``inbox`` argument)."""
        return self._inbox

    @property
    def inbox_suffix(self) -> str:
        """What ends every channel of :meth:`inbox`: ``:<inbox id>``."""
        return f":{self._inbox}"

    def check_name(self, name: str) -> None:
        """On Cluster, a name starting with ``}`` is refused: its keys ``prefix:{}…`` have
        an empty hash tag, so Cluster would hash each whole key and scatter the lock and
        its fence over different slots (``CROSSSLOT``). Raises ``ValueError``."""
        if self._cluster and name.startswith("}"):
            raise ValueError(
                f"lock name {name!r} starts with '}}', which Redis Cluster cannot keep in one "
                "slot (its keys would have an empty hash tag); use a name that does not "
                "start with '}'"
            )

    def keys(self, name: str) -> Keys:
        """The lock key, fence counter key, wake-up channel and waiter queue of ``name``
        (and, as properties, its readers' and its semaphore's keys)."""
        base = f"{self._prefix}:{{{name}}}"
        return Keys(base, f"{base}:fence", f"{base}:wake", f"{base}:queue", f"{base}:due")

    def channel(self, name: str) -> str:
        """The pub/sub channel that wakes waiters for ``name`` (Redlock's, which do not
        queue; queued waiters hear their own :meth:`inbox`)."""
        return f"{self._prefix}:{{{name}}}:wake"

    def inbox(self, name: str) -> str:
        """The channel on which this backend's queued waiters for ``name`` are woken."""
        return f"{self._prefix}:{{{name}}}:wake:{self._inbox}"

    def topic_channel(self, topic: str) -> str:
        """The pub/sub channel of a topic (an election's announcements)."""
        return f"{self._prefix}:{{{topic}}}:news"
