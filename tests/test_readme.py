"""The README's examples run, and its set-up commands match what CI runs."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from asynclock.postgres import advisory_key

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
# A program runs as written: an async one ends in asyncio.run(), a blocking one in main().
PROGRAMS = [block for block in BLOCKS if "asyncio.run(" in block or block.endswith("\nmain()\n")]
FRAGMENTS = [block for block in BLOCKS if block not in PROGRAMS]


def test_programs_type_check(tmp_path: Path) -> None:
    """Every complete program passes ``mypy --strict``, as a user's file would (one run
    over all of them: a program is a module of its own)."""
    from mypy import api  # noqa: PLC0415 - a test extra, only this test needs it

    for index, program in enumerate(PROGRAMS):
        (tmp_path / f"readme_program_{index}.py").write_text(program)
    out, err, status = api.run(
        [
            "--strict",
            "--no-incremental",
            "--cache-dir",
            os.devnull,
            *(str(path) for path in sorted(tmp_path.glob("*.py"))),
        ]
    )
    assert status == 0, out + err


def test_readme_has_examples() -> None:
    """The README shows complete programs and fragments."""
    assert len(PROGRAMS) >= 2
    assert FRAGMENTS


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=lambda b: b.strip().splitlines()[0][:40])
def test_fragments_compile(fragment: str) -> None:
    """Every fragment is valid Python (top-level await allowed)."""
    compile(fragment, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda b: f"{len(b)}-chars")
def test_programs_run(program: str, asynclock_redis_url: str) -> None:
    """Every complete program runs as written, against the test Valkey."""
    source = program.replace("redis://127.0.0.1:6379/0", asynclock_redis_url)
    done = subprocess.run(  # noqa: S603 - our own README, run with our own interpreter
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


async def test_key_sql_matches_the_library(asynclock_postgres_dsn: str) -> None:
    """The README's SQL for the name-to-key mapping gives the number it says, which is
    what asynclock computes."""
    (block,) = [
        b for b in re.findall(r"```sql\n(.*?)```", README, flags=re.DOTALL) if "sha256" in b
    ]
    expected = int(block.rsplit("--", 1)[1])
    conn = await asyncpg.connect(asynclock_postgres_dsn)
    try:
        assert await conn.fetchval(block.split(";")[0]) == expected
    finally:
        await conn.close()
    assert advisory_key("invoice:42") == expected


def test_scheduler_example_runs() -> None:
    """examples/scheduler.py leads, runs its job and resigns (memory://, 2 seconds)."""
    done = subprocess.run(  # noqa: S603 - our own example, run with our own interpreter
        [sys.executable, str(ROOT / "examples" / "scheduler.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "SCHEDULER_SECONDS": "2"},
    )
    assert done.returncode == 0, done.stderr
    assert "leading, term 1" in done.stdout
    assert "job #1 under term 1" in done.stdout


@pytest.mark.parametrize("example", ["fastapi_service.py", "aiohttp_service.py"])
def test_service_examples_serve(example: str) -> None:
    """The web examples import and build their application (memory://)."""
    code = (
        "import runpy, sys; sys.argv = ['x'];"
        f"ns = runpy.run_path({str(ROOT / 'examples' / example)!r}, run_name='example');"
        "print(sorted(k for k in ns if k in ('app', 'make_app')))"
    )
    done = subprocess.run(  # noqa: S603 - our own example, run with our own interpreter
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "app" in done.stdout


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs the README's test command, so the two never drift apart."""
    command = next(
        line
        for line in README.splitlines()
        if "pip install -e '.[test]' -e ./plugin" in line and "pytest" in line
    )
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[test]' -e ./plugin" in ci
    assert command.split("&&")[-1].strip().replace(".venv/bin/", "") in ci


def test_main_job_runs_on_embedded_servers() -> None:
    """The README's main-job command names the installed console script and an existing
    extra, and that command, shortened with --quick, runs on embedded servers."""
    line = next(line for line in README.splitlines() if "-e '.[bench]'" in line)
    command = line.split("&&")[-1].split()
    assert command[0] == ".venv/bin/asynclock"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'asynclock = "asynclock.cli:main"' in pyproject
    assert re.search(r"^bench = \[", pyproject, flags=re.MULTILINE)
    script = Path(sys.executable).parent / "asynclock"
    assert script.exists(), "the asynclock console script is not installed"
    done = subprocess.run(  # noqa: S603 - our own console script
        [str(script), *command[1:], "--quick", "--only", "uncontended", "--no-peers", "--plain"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "asynclock async with" in done.stdout
    assert "Targets" in done.stdout
