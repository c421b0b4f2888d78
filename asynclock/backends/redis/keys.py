"""The key schema: the keys and channels behind a lock name, and their hash tag.

Every key and channel of a name is ``{prefix}:{{name}}...``: they share the hash tag
``{name}``, so that a lock, its fence counter, its queues and its wake-up channels live
in one Redis Cluster slot and one script may touch them all. :mod:`.scripts` lists what
each key holds.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ("KeySchema", "Keys", "check_prefix")


def check_prefix(prefix: object) -> str:
    """``prefix`` if it can head keys: a non-empty ``str`` without braces (which would
    move the hash tag). Raises ``TypeError`` or ``ValueError``."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if not prefix or "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must be non-empty and free of '{{' and '}}', got {prefix!r}")
    return prefix


class Keys(NamedTuple):
    """The names behind one lock; they share the hash tag ``{name}``.

    The keys of read-write locks and semaphores are properties, made when asked for:
    a plain lock never pays for their names.
    """

    lock: str
    fence: str
    channel: str
    queue: str  # exclusive waiters in arrival order (a sorted set)
    due: str  # when each waiter's place in the queue lapses (a hash)

    @property
    def released(self) -> str:
        """Values whose release of the lock (or of a reader) ran lately (a sorted set:
        SHA1 of the value -> when that memory ends, ms): a release sent again finds its
        own."""
        return self.lock + ":released"

    @property
    def readers(self) -> str:
        """Readers holding the name (a sorted set: value -> expiry, ms)."""
        return self.lock + ":readers"

    @property
    def reader_grants(self) -> str:
        """Each reader's fence (a hash)."""
        return self.lock + ":readers:grants"

    @property
    def reader_queue(self) -> str:
        return self.lock + ":readers:queue"

    @property
    def reader_due(self) -> str:
        return self.lock + ":readers:due"

    @property
    def permits(self) -> str:
        """Holders of the semaphore ``name`` (a sorted set: value -> expiry, ms)."""
        return self.lock + ":permits"

    @property
    def permit_fence(self) -> str:
        """The semaphore's own fence counter."""
        return self.lock + ":permits:fence"

    @property
    def permit_grants(self) -> str:
        return self.lock + ":permits:grants"

    @property
    def permit_queue(self) -> str:
        return self.lock + ":permits:queue"

    @property
    def permit_due(self) -> str:
        return self.lock + ":permits:due"

    @property
    def permit_released(self) -> str:
        """Values whose permit's release ran lately (as :attr:`released`)."""
        return self.lock + ":permits:released"


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
