"""``asynclock inspect`` on Sentinel and Cluster URLs and ASYNCLOCK_URL; ``asynclock serve``."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from pytest_asynclock import ClusterSetup, SentinelSetup

import asynclock
from asynclock.cli import main

EXIT_HELD, EXIT_USAGE = 0, 2


async def _inspect_held(url: str, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Hold a lock on ``url`` and run ``asynclock inspect`` on it (in this process, off
    the event loop so the lease keeps being renewed); what it printed."""
    name = f"cli:{uuid.uuid4().hex[:10]}"
    async with asynclock.connect(url, identity="topo") as coord, coord.lock(name, ttl=30):
        code = await asyncio.to_thread(main, ["inspect", name, *args])
    out, err = capsys.readouterr()
    assert code == EXIT_HELD, err
    return out


class TestInspectTopologies:
    async def test_sentinel_url_from_the_environment(
        self,
        asynclock_sentinel: SentinelSetup,
        capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """inspect takes a redis+sentinel:// URL, from ASYNCLOCK_URL when --url is absent."""
        monkeypatch.setenv("ASYNCLOCK_URL", asynclock_sentinel.url)
        assert "held by topo" in await _inspect_held(asynclock_sentinel.url, capsys)

    @pytest.mark.parametrize("asynclock_cluster", [0], indirect=True)
    async def test_cluster_url(
        self, asynclock_cluster: ClusterSetup, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """inspect takes a redis+cluster:// URL."""
        url = asynclock_cluster.url
        assert "held by topo" in await _inspect_held(url, capsys, "--url", url)

    def test_no_url_anywhere_is_a_usage_error(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without --url and ASYNCLOCK_URL, inspect says which of the two to give (exit 2)."""
        monkeypatch.delenv("ASYNCLOCK_URL", raising=False)
        assert main(["inspect", "x"]) == EXIT_USAGE
        assert "ASYNCLOCK_URL" in capsys.readouterr().err


def test_serve_prints_a_url_and_stops_its_server_on_sigterm() -> None:
    """asynclock serve prints a working Valkey URL; SIGTERM stops that server, removes its
    folder and exits 0."""
    with subprocess.Popen(
        [sys.executable, "-m", "asynclock", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            assert url.startswith("redis://127.0.0.1:"), url
            client = redis.Redis.from_url(url)
            try:
                pid = int(client.info("server")["process_id"])
                folder = Path(str(client.config_get("dir")["dir"]))
            finally:
                client.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not Path(f"/proc/{pid}").exists()
    assert not folder.exists()
