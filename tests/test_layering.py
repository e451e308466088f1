"""The layering the design promises: the Runtime and the checkpoint never ask which backend runs,
and backends and checkpoints meet only in the neutral ``mpt.state``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mpt
from mpt.backends import registered

PACKAGE = Path(mpt.__file__).parent
NEUTRAL = [PACKAGE / "runtime.py", PACKAGE / "step.py",
           *sorted((PACKAGE / "checkpoint").glob("*.py"))]


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (they may name backends: they explain)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            found.add(id(body[0].value))
    return found


def _words(path: Path) -> list[tuple[int, str]]:
    """Every name, attribute, import and non-docstring string of a module, with its line."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            words.append((node.lineno, node.attr))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            words += [(node.lineno, alias.name) for alias in node.names]
            if isinstance(node, ast.ImportFrom) and node.module:
                words.append((node.lineno, node.module))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docs):
            words.append((node.lineno, node.value))
    return words


@pytest.mark.parametrize("path", NEUTRAL, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_backend_is_named_where_the_runtime_and_checkpoints_live(path):
    names = [name for name in registered() if name]
    named = [f"{path.name}:{line}: {word!r} names {name}" for line, word in _words(path)
             for name in names if name in word.lower()]
    assert not named, "\n".join(named)


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


@pytest.mark.parametrize(("importer", "imported"), [("checkpoint", "mpt.backends"),
                                                    ("backends", "mpt.checkpoint")])
def test_backends_and_checkpoints_do_not_import_each_other(importer, imported):
    found = [f"{path.relative_to(PACKAGE)} imports {module}"
             for path in sorted((PACKAGE / importer).glob("*.py"))
             for module in _imports(path) if module == imported
             or module.startswith(imported + ".")]
    assert not found, "\n".join(found)


def test_no_two_packages_import_each_other():
    """The packages of ``mpt`` form layers: a cycle (backends <-> pipeline was one) would
    make each half unimportable without the other and hide which one owns a concept."""
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    uses = {name: {module.split(".")[1] for path in (PACKAGE / name).rglob("*.py")
                   for module in _imports(path) if module.startswith("mpt.")
                   and module.split(".")[1] in packages and module.split(".")[1] != name}
            for name in packages}
    reach = {name: set(used) for name, used in uses.items()}
    for _ in packages:  # the transitive closure, one more step each round
        for name in packages:
            reach[name] |= {far for near in reach[name] for far in reach[near]}
    cycles = sorted(name for name in packages if name in reach[name])
    assert not cycles, f"packages on an import cycle: {', '.join(cycles)}"
