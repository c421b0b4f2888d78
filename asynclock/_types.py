"""Type aliases the package's modules share."""

from __future__ import annotations

from types import TracebackType
from typing import TypeAlias

__all__ = ("ExcType", "ExcValue", "Traceback")

#: The arguments of ``__exit__`` / ``__aexit__``.
ExcType: TypeAlias = type[BaseException] | None
ExcValue: TypeAlias = BaseException | None
Traceback: TypeAlias = TracebackType | None
