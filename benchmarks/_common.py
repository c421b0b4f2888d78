"""What the benchmark scripts share: they are thin front ends to ``asynclock bench``.

The suite itself is the package ``benchmarks.suite`` (importable from an editable install
of the repository, where ``asynclock bench`` runs it too); these scripts keep their
historical command lines and pick the part of the suite they are about.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, NoReturn

from benchmarks.suite import FULL, Settings
from benchmarks.suite.command import bench_command


def settings(**changes: Any) -> Settings:
    """The full suite's settings with ``changes``."""
    return dataclasses.replace(FULL, **changes)


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of ``doc``, with ``--json``."""
    out = argparse.ArgumentParser(
        description=doc.split("\n\n", maxsplit=1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    out.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    out.add_argument("--chart", metavar="PATH", help="also draw a PNG chart here")
    return out


def run(**options: Any) -> NoReturn:
    """Run the suite with ``options`` (see ``benchmarks.suite.command.run_bench``) and exit."""
    sys.exit(bench_command(**options))
