"""The PostgreSQL advisory-lock keys of names: how a lock's, a permit's, a semaphore's
waiting flag's and a fence step's keys are derived from a name and a namespace.

Pure functions, the one definition both the session backend
(``asynclock.backends.postgres``) and the transaction-level helpers
(``asynclock.postgres``, which re-exports them) use: any language can compute the same
keys. Every key is the start of a SHA-256 digest; the inputs of different kinds of key
never coincide (see :func:`permit_prefix`).
"""

from __future__ import annotations

import hashlib

from ._validate import check_name

__all__ = (
    "DEFAULT_NAMESPACE",
    "advisory_key",
    "fence_ids",
    "key_in",
    "lock_ids",
    "permit_fence_ids",
    "permit_key",
    "permit_prefix",
    "waiting_key",
)

#: The namespace mixed into every key unless another is configured.
DEFAULT_NAMESPACE = "asynclock"


def advisory_key(name: str, namespace: str = DEFAULT_NAMESPACE) -> int:
    """The 64-bit advisory-lock key of ``name``: stable, documented, any language can
    compute it.

    ``key = first 8 bytes of SHA-256(UTF-8(namespace) + b"\\x00" + UTF-8(name))``, read as a
    big-endian *signed* 64-bit integer (PostgreSQL's ``bigint``). Locks taken with this
    one-argument (``bigint``) form never conflict with the two-``int4`` form
    (``pg_advisory_lock(int, int)``): PostgreSQL tags them differently.

    >>> advisory_key("invoice:42")
    -3222681048253742227
    """
    check_name(name)
    check_name(namespace, "namespace")
    return key_in(namespace.encode() + b"\x00", name)


def key_in(prefix: bytes, name: str) -> int:
    """:func:`advisory_key` for ``prefix = UTF-8(namespace) + b"\\x00"``, unchecked."""
    digest = hashlib.sha256(prefix + name.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def permit_prefix(namespace: str, name: str) -> bytes:
    """The bytes every permit key of semaphore ``name`` is hashed from, before the slot.

    ``UTF-8(namespace) + b"\\x00" + UTF-8(name) + b"\\xff"``: the same start as a lock's
    key, then a byte that never occurs in UTF-8, so no lock name hashes the same input.
    """
    return namespace.encode() + b"\x00" + name.encode() + b"\xff"


def permit_key(name: str, slot: int, namespace: str = DEFAULT_NAMESPACE) -> int:
    """The 64-bit advisory-lock key of permit ``slot`` (0 to limit - 1) of semaphore ``name``.

    ``key = first 8 bytes of SHA-256(UTF-8(namespace) + b"\\x00" + UTF-8(name) + b"\\xff" +
    ASCII(decimal slot))``, big-endian signed, like :func:`advisory_key`. ``0xFF`` never
    occurs in UTF-8, so permit keys and lock keys are hashed from different inputs: a
    semaphore never shares keys with the lock of the same name.

    >>> permit_key("api-quota", 0) == permit_key("api-quota", 0, "asynclock")
    True
    """
    check_name(name)
    check_name(namespace, "namespace")
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise ValueError(f"slot must be an int >= 0, got {slot!r}")
    digest = hashlib.sha256(permit_prefix(namespace, name) + str(slot).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def waiting_key(name: str, namespace: str = DEFAULT_NAMESPACE) -> int:
    """The key permit waiters of semaphore ``name`` hold (shared) while they wait.

    ``SHA-256(permit_prefix + b"waiting")``: not a decimal slot, so never a permit key. A
    release that cannot take it exclusively knows someone waits and sends a NOTIFY.
    """
    digest = hashlib.sha256(permit_prefix(namespace, name) + b"waiting").digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def fence_ids(key: int) -> tuple[int, int]:
    """The ``(int4, int4)`` fence key of advisory key ``key`` (a lock's): the
    transaction-level lock ``pg_advisory_xact_lock(a, b)`` that serialises the fence step
    of every holder of the key, exclusive, shared or in a transaction.

    ``first 8 bytes of SHA-256(key as 8 big-endian bytes + b"fence")``, read as two
    big-endian signed 32-bit integers. The two-argument form never conflicts with the
    ``bigint`` locks, and a hash keeps it apart from an application's own two-int locks
    on the halves of a key (:func:`lock_ids`).
    """
    return _int4_pair(hashlib.sha256(key.to_bytes(8, "big", signed=True) + b"fence").digest())


def permit_fence_ids(name: str, namespace: str = DEFAULT_NAMESPACE) -> tuple[int, int]:
    """The ``(int4, int4)`` fence key of semaphore ``name``, shared by all its permits:
    ``SHA-256(permit_prefix + b"fence")``, read as :func:`fence_ids` reads its digest."""
    return _int4_pair(hashlib.sha256(permit_prefix(namespace, name) + b"fence").digest())


def _int4_pair(digest: bytes) -> tuple[int, int]:
    return (
        int.from_bytes(digest[:4], "big", signed=True),
        int.from_bytes(digest[4:8], "big", signed=True),
    )


def lock_ids(key: int) -> tuple[int, int]:
    """``(classid, objid)`` under which ``pg_locks`` shows a ``bigint`` key (objsubid 1)."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF
