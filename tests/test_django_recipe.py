"""The Django recipe (``examples/django_recipe``) against the test Valkey: its view through
Django's test client, its management command through ``call_command`` and ``manage.py``.

Django's settings are process-global, so the recipe runs in subprocesses of its own
(:func:`child`, with ``DJANGO_SETTINGS_MODULE=shop.settings``): nothing Django configures
leaks into this process or the other test modules, under pytest-xdist as in one process.
The contending holder is this process, through a coordinator of its own: another process,
as in production. Lock names are unique to each test (the server is shared).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest

import asynclock.sync

pytest.importorskip("django", reason="the Django recipe needs Django (the test extra has it)")

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "django_recipe"

#: How long one child may take on a loaded machine (the view waits 5 s for a held lock).
DEADLINE = 60.0

#: What a child runs: :func:`child`, with the action in ``sys.argv``.
CHILD = "from tests.test_django_recipe import child\n\nchild()\n"


def child() -> None:
    """In a subprocess: set Django up with the recipe's settings, run one action, and
    print its outcome as JSON. ``pay PK``: ``POST /invoices/PK/pay`` through Django's test
    client; ``pay-forked PK``: that, then again in a forked child; ``report DAY``:
    ``call_command("nightly_report", day=DAY)``."""
    import io  # noqa: PLC0415 - the child's imports: Django is set up here only

    import django  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415
    from django.test import Client  # noqa: PLC0415
    from django.test.utils import setup_test_environment  # noqa: PLC0415

    django.setup()
    setup_test_environment()  # lets the test client's host in, as Django's test runner does
    action, argument = sys.argv[1:3]
    outcome: dict[str, Any]
    if action == "pay":
        response = Client().post(f"/invoices/{argument}/pay")
        outcome = {
            "status": response.status_code,
            "body": response.json(),
            "retry_after": response.headers.get("Retry-After"),
        }
    elif action == "pay-forked":
        outcome = {"status": Client().post(f"/invoices/{argument}/pay").status_code}
        outcome["forked_status"] = _pay_in_a_fork(Client, argument)
    elif action == "report":
        out = io.StringIO()
        call_command("nightly_report", day=argument, stdout=out)
        outcome = {"output": out.getvalue()}
    else:
        raise SystemExit(f"unknown action {action!r}")
    print(json.dumps(outcome))  # the parent reads it


def _pay_in_a_fork(client: Any, pk: str) -> int:
    """As gunicorn's ``--preload`` does: the WSGI app loaded (and here, the coordinator
    used) in the parent, then a fork; the child pays ``pk``. Its answer's status."""
    importlib.import_module("shop.wsgi")  # loads the app, as gunicorn's master does

    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # the forked worker: bounded, and reports through the pipe
        signal.alarm(int(DEADLINE / 2))
        status = 0
        try:
            status = client().post(f"/invoices/{pk}/pay").status_code
        finally:
            os.write(write, str(status).encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        status = int(answer.read() or 0)
    os.waitpid(pid, 0)
    return status


def environment(url: str) -> dict[str, str]:
    """A child's environment: the recipe's settings, on the test Valkey."""
    return {
        **os.environ,
        "ASYNCLOCK_URL": url,
        "DJANGO_SETTINGS_MODULE": "shop.settings",
        "PYTHONPATH": os.pathsep.join([str(RECIPE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def run(url: str, *command: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (after the interpreter) in the recipe's folder; it must succeed."""
    done = subprocess.run(  # noqa: S603 - our own interpreter, recipe and test module
        [sys.executable, "-W", "error", *command],
        cwd=RECIPE,
        env=environment(url),
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert done.returncode == 0, f"{command} exited with {done.returncode}\n{done.stderr}"
    return done


def in_child(url: str, action: str, argument: str) -> dict[str, Any]:
    """The outcome of :func:`child` ``action argument``."""
    done = run(url, "-c", CHILD, action, argument)
    outcome: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome


def test_view_pays_under_the_lock(asynclock_redis_url: str) -> None:
    """The view answers 200 with the lease's fence, and releases the lock."""
    pk = str(uuid.uuid4().int % 10**9)
    outcome = in_child(asynclock_redis_url, "pay", pk)
    assert outcome["status"] == 200, outcome
    assert outcome["body"]["paid"] is True
    assert isinstance(outcome["body"]["fence"], int)
    with asynclock.sync.connect(asynclock_redis_url) as coord:
        assert not coord.is_locked(f"invoice:{pk}")


def test_view_answers_423_while_another_process_holds_the_invoice(
    asynclock_redis_url: str,
) -> None:
    """While this process holds ``invoice:PK``, the view waits its 5 s and answers 423
    with ``Retry-After``; once released, it pays under a newer fence."""
    pk = str(uuid.uuid4().int % 10**9)
    with asynclock.sync.connect(asynclock_redis_url) as coord:
        with coord.lock(f"invoice:{pk}", ttl=30) as held:
            refused = in_child(asynclock_redis_url, "pay", pk)
            assert refused["status"] == 423, refused
            assert refused["retry_after"] == "1"
            held.check()  # still ours: the view never took it
        paid = in_child(asynclock_redis_url, "pay", pk)
    assert paid["status"] == 200, paid
    assert paid["body"]["fence"] > held.fence


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")
def test_coordinator_made_before_a_fork_works_in_the_child(asynclock_redis_url: str) -> None:
    """The recipe's coordinator, made and used before a fork (gunicorn's ``--preload``),
    locks in the forked child too: the child's request is paid."""
    pk = str(uuid.uuid4().int % 10**9)
    outcome = in_child(asynclock_redis_url, "pay-forked", pk)
    assert outcome == {"status": 200, "forked_status": 200}


def test_nightly_report_runs_once_at_a_time(asynclock_redis_url: str) -> None:
    """``nightly_report`` builds the report when nobody else does (``call_command``),
    is skipped while another process builds the same day (this one holds its lock), and
    runs again afterwards (``python manage.py nightly_report``)."""
    day = f"test-{uuid.uuid4().hex[:12]}"
    ran = in_child(asynclock_redis_url, "report", day)
    assert ran["output"].strip() == f"report {day}: 3 pages"
    with asynclock.sync.connect(asynclock_redis_url) as coord:
        with coord.lock(f"report:{day}", ttl=30):
            skipped = in_child(asynclock_redis_url, "report", day)
            assert "skipped, another process is building it" in skipped["output"]
        again = run(asynclock_redis_url, "manage.py", "nightly_report", "--day", day)
        assert again.stdout.strip() == f"report {day}: 3 pages"
        assert not coord.is_locked(f"report:{day}")
