"""The store is the only door to PostgreSQL, and it looks only down: read from the import statements
of every module of ``src/chimes`` (``ast``, so imports inside functions and ``TYPE_CHECKING`` blocks
count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import chimes

SOURCE = Path(chimes.__file__).parent
DRIVER = "asyncpg"
STORE = "chimes.store"
# The chaos harness (its own package, chimes_chaos, beside this tree) checks Chimes from outside: its
# observer and its evidence read the database on connections and statements of their own, so that a
# bug in the store cannot hide itself from them.
DRIVER_ALLOWED = (STORE,)
# chimes.security is policy too (sealing secrets, signing): the services apply it, the store stores.
ABOVE_THE_STORE = ("chimes.api", "chimes.cli", "chimes.dashboard", "chimes.worker", "chimes.scheduler",
                   "chimes.services", "chimes.security", "chimes.wire")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, absolute, with the line of its import statement."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    return imports_of(path.read_text(), package)


def imports_of(source: str, package: str) -> list[tuple[int, str]]:
    """What ``source``, a module of ``package``, imports: each name a ``from`` statement takes counts
    as a module too (``from chimes import worker``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _modules() -> list[tuple[str, Path]]:
    return [(_module_name(path), path) for path in sorted(SOURCE.rglob("*.py"))]


def test_the_source_tree_is_found() -> None:
    names = {name for name, _ in _modules()}
    assert {"chimes.store.db", "chimes.api.app", "chimes.worker.worker"} <= names


def test_only_the_store_imports_the_driver() -> None:
    outside = [f"{path.relative_to(SOURCE.parent)}:{line}: import {imported}"
               for name, path in _modules() if not any(_within(name, allowed) for allowed in DRIVER_ALLOWED)
               for line, imported in _imports(path) if _within(imported, DRIVER)]
    assert outside == [], "modules outside chimes.store import the database driver:\n" + "\n".join(outside)


def test_the_store_imports_nothing_above_it() -> None:
    upward = [f"{path.relative_to(SOURCE.parent)}:{line}: import {imported}"
              for name, path in _modules() if _within(name, STORE)
              for line, imported in _imports(path) if any(_within(imported, up) for up in ABOVE_THE_STORE)]
    assert upward == [], "chimes.store imports from the layers above it:\n" + "\n".join(upward)


def test_imports_are_read_wherever_they_are() -> None:
    source = """
import asyncpg.exceptions
from .. import worker
from ..scheduler.node import SchedulerNode
def f():
    from chimes.api import app
if TYPE_CHECKING:
    from . import db
"""
    names = [name for _, name in imports_of(source, "chimes.store")]
    assert "asyncpg.exceptions" in names
    assert "chimes.worker" in names
    assert "chimes.scheduler.node" in names
    assert "chimes.api.app" in names
    assert "chimes.store.db" in names
