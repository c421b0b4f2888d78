"""The engine's modules talk through public names and import each other without a cycle:
no module reaches into another object's private attributes, and the imports of
``asynclock/`` (``TYPE_CHECKING`` ones included) form layers, never a loop."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asynclock"

#: The modules that make the engine: coordinator, locks and leases, renewals, elections,
#: decorators and what they share.
ENGINE = (
    "_coordinator",
    "_decorators",
    "_election",
    "_engine",
    "_lease",
    "_lock",
    "_stats",
    "_tasks",
    "_wakeup",
    "_watchdog",
)

#: ``(module, expression)`` of private reaches allowed on purpose: private APIs of the
#: standard library or a third-party package that have no public equivalent. None is
#: needed today; each entry must say why.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _private(name: str) -> bool:
    """A private attribute name (``_x``), not a dunder (``__aenter__``)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _reaches(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, expression)`` of every ``X._name`` whose ``X`` is not ``self`` or ``cls``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        yield node.lineno, ast.unparse(node)


def _module_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs (or declares under ``TYPE_CHECKING``) at module level:
    not those inside a function, which load on first call."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If | ast.Try):
            pending.extend(node.body)
            pending.extend(node.orelse)
            if isinstance(node, ast.Try):
                for handler in node.handlers:
                    pending.extend(handler.body)
                pending.extend(node.finalbody)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``asynclock._lock``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(
    module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]
) -> set[str]:
    """The package's modules ``node`` (in ``module``, at ``path``) imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if node.level:
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    targets = set()
    for alias in node.names:
        # ``from . import _decorators`` names a module; ``from ._lock import Lease`` a name.
        target = f"{base}.{alias.name}"
        targets.add(target if target in known else base)
    return targets & known


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in _module_imports(tree):
            edges |= _imported(module, path, node, known)
        graph[module] = edges - {module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_the_engine_reaches_into_no_private_attribute() -> None:
    """No engine module reads or writes another object's ``_private`` attribute."""
    reaches = []
    for name in ENGINE:
        path = PACKAGE / f"{name}.py"
        for line, expression in _reaches(ast.parse(path.read_text(), str(path))):
            if (name, expression) not in ALLOWED:
                reaches.append(f"asynclock/{name}.py:{line}: {expression}")
    assert reaches == [], "\n".join(reaches)


def test_the_package_imports_form_no_cycle() -> None:
    """The module-level imports of asynclock/ (TYPE_CHECKING ones too) have no cycle."""
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])
