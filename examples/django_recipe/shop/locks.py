"""One asynclock coordinator per process."""

import functools

from django.conf import settings

import asynclock.sync


@functools.cache
def coordinator() -> asynclock.sync.Coordinator:
    """This process's coordinator, made on first use and kept (closed at exit).

    ``connect()`` does no I/O and starts no thread until the first lock, and a forked
    child (gunicorn's preforked workers, ``--preload`` or not) reconnects by itself on
    its first use: it may be made before the fork.
    """
    return asynclock.sync.connect(settings.ASYNCLOCK_URL)
