"""Every benchmark case in one run: the same as the installed ``asynclock bench``.

    python benchmarks/run.py              # embedded Valkey x5 + PostgreSQL; bench.json, .png
    python benchmarks/run.py --quick      # seconds, for CI and the README
    python benchmarks/run.py --url redis://host:6379/0 --pg postgresql://... --runs 3

Takes every option of ``asynclock bench`` (``--help`` lists them); unlike the command, it
writes ``bench.json`` and ``bench.png`` in the current directory unless ``--json`` /
``--chart`` say otherwise.
"""

from __future__ import annotations

import sys

from asynclock.cli import main


def with_defaults(argv: list[str]) -> list[str]:
    """``argv`` with ``--json bench.json`` and ``--chart bench.png`` unless given."""
    args = list(argv)
    if "-h" in args or "--help" in args:
        return args
    for option, default in (("--json", "bench.json"), ("--chart", "bench.png")):
        if not any(a == option or a.startswith(option + "=") for a in args):
            args += [option, default]
    return args


if __name__ == "__main__":
    sys.exit(main(["bench", *with_defaults(sys.argv[1:])]))
