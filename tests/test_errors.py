"""What lock errors tell their catcher: why a timeout happened, and which lock it is about."""

from __future__ import annotations

import logging

import pytest

import asynclock
from tests.conftest import MakeCoord


class TestContentionTimeout:
    async def test_a_timeout_from_contention_says_the_lock_is_held(
        self, make_coord: MakeCoord
    ) -> None:
        """A timeout while another holder keeps the lock blames the holder, not the server,
        carries no TimeoutError cause, and names the lock."""
        holder, waiter = make_coord(), make_coord()
        lease = await holder.lock("busy", ttl=30).acquire()
        for timeout in (0.05, 0.3):
            with pytest.raises(asynclock.LockTimeout) as caught:
                await waiter.lock("busy", ttl=30, timeout=timeout).acquire()
            assert "held by another holder" in str(caught.value), str(caught.value)
            assert "did not answer" not in str(caught.value)
            assert caught.value.__cause__ is None
            assert caught.value.name == "busy"
        await lease.release()


class TestErrorNames:
    async def test_lock_errors_carry_the_lock_name(self, make_coord: MakeCoord) -> None:
        """LockTimeout, LockNotOwned and LockLost carry the lock's name as ``name``."""
        coord = make_coord()
        lease = await coord.lock("named", ttl=30).acquire()
        with pytest.raises(asynclock.LockTimeout) as timed_out:
            await coord.lock("named", timeout=0).acquire()
        assert timed_out.value.name == "named"
        await lease.release()
        with pytest.raises(asynclock.LockNotOwned) as not_owned:
            await lease.release()
        assert not_owned.value.name == "named"
        with pytest.raises(asynclock.LockLost) as lost:
            async with coord.lock("named", ttl=30, cancel_on_lost=False) as held:
                held.mark_lost("lost on purpose")  # what a refused renewal does
        assert lost.value.name == "named"


def test_the_library_logger_has_a_null_handler() -> None:
    """The "asynclock" logger has a NullHandler: a caught error prints nothing by itself."""
    handlers = logging.getLogger("asynclock").handlers
    assert any(isinstance(handler, logging.NullHandler) for handler in handlers)
