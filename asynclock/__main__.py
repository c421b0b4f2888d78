"""``python -m asynclock``: the ``asynclock`` command (see :mod:`asynclock.cli`)."""

import sys

from .cli import main

sys.exit(main())
