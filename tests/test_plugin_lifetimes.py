"""The plugin's servers go with the pytest run that started them, however it ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A session that starts the shared Valkey (and, when asked, a PostgreSQL), says where
# they are, and then waits to be killed.
SESSION = textwrap.dedent(
    """
    import json, os, time

    def test_hold(request, asynclock_redis_server{pg_arg}):
        servers = [asynclock_redis_server{pg_list}]
        pids = [s.pid for s in servers]
        for s in servers:
            pids += s.child_pids() if hasattr(s, "child_pids") else []
        record = {{"pids": pids, "dirs": [str(s.tmpdir) for s in servers]}}
        with open(os.environ["RECORD"] + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(os.environ["RECORD"] + ".tmp", os.environ["RECORD"])
        time.sleep(120)
    """
)


def _poll(predicate: Callable[[], bool], timeout: float) -> None:
    """Wait until ``predicate`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def _start_session(
    tmp_path: Path, *, postgres: bool
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start the session in its own pytest process; return it and what it started."""
    pg_arg = ", asynclock_postgres_factory" if postgres else ""
    pg_list = ", *asynclock_postgres_factory()" if postgres else ""
    (tmp_path / "test_hold.py").write_text(SESSION.format(pg_arg=pg_arg, pg_list=pg_list))
    record = tmp_path / "record.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCLOCK_")}
    # Only this plugin: other plugins' imports would triple the start-up time.
    env.update(RECORD=str(record), ASYNCLOCK_NO_DOCKER="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    argv = ["-q", "-p", "no:cacheprovider", "-p", "pytest_asynclock.plugin", "test_hold.py"]
    proc = subprocess.Popen(  # noqa: S603 - our own interpreter and test file
        [sys.executable, "-m", "pytest", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _poll(record.exists, timeout=60)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, json.loads(record.read_text())


class TestServerLifetimes:
    def test_sigterm_stops_servers_and_removes_their_folders(self, tmp_path: Path) -> None:
        """SIGTERM to pytest stops its Valkey and PostgreSQL and removes their folders."""
        proc, started = _start_session(tmp_path, postgres=True)
        assert started["pids"]
        assert all(_alive(pid) for pid in started["pids"])
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert not [pid for pid in started["pids"] if _alive(pid)]
        assert not [d for d in started["dirs"] if Path(d).exists()]

    def test_a_later_run_stops_what_a_sigkilled_one_left(self, tmp_path: Path) -> None:
        """After SIGKILL of pytest, the next process that starts a server stops the
        orphan by its PID and removes its folder."""
        proc, started = _start_session(tmp_path, postgres=False)
        proc.kill()
        proc.wait(timeout=10)
        assert all(_alive(pid) for pid in started["pids"]), "the scenario needs an orphan"
        later = subprocess.run(
            [sys.executable, "-c", "from pytest_asynclock import start_valkey; start_valkey()"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert later.returncode == 0, later.stderr
        assert not [pid for pid in started["pids"] if _alive(pid)]
        assert not [d for d in started["dirs"] if Path(d).exists()]
