"""The package's modules import each other without cycles.

A cycle among module-level imports means one module runs against a half-initialized other (the
order two roles happen to import them in decides whether an attribute exists yet). An import
deferred into a function hides a cycle from Python but not from the reader: the two modules
still need each other, and every role that imports one imports both. So two graphs are checked:
module-level imports (in ``if``/``try`` blocks too), and every import including those inside
functions. Imports under ``if TYPE_CHECKING:`` never run and do not count. Importing ``a.b.c``
also runs ``a`` and ``a.b`` first, so each import depends on the packages above its target too.

Run alone: ``.venv/bin/pytest -q tests/test_imports.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dorylus", "graphserver", "lambdas")


def module_files() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _runtime_statements(body: list[ast.stmt], deferred: bool):
    """The statements of ``body`` that run on import (``deferred``: or later, in a function):
    descends into if/try/with blocks and classes, skips ``if TYPE_CHECKING:`` branches."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if deferred:
                yield from _runtime_statements(node.body, deferred)
            continue
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                yield from _runtime_statements(node.orelse, deferred)
                continue
            yield from _runtime_statements(node.body, deferred)
            yield from _runtime_statements(node.orelse, deferred)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _runtime_statements(block, deferred)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.ClassDef, ast.For, ast.While)):
            yield from _runtime_statements(node.body, deferred)
        else:
            yield node


def _with_parents(name: str, modules: dict[str, Path]) -> set[str]:
    """``name`` and the packages above it that are modules of ours."""
    parts = name.split(".")
    return {".".join(parts[:k]) for k in range(1, len(parts) + 1)} & modules.keys()


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """``{module: modules it imports}`` among the packages' modules: on import, or (``deferred``)
    at any time."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _runtime_statements(ast.parse(path.read_text(), str(path)).body, deferred):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    deps |= _with_parents(alias.name, modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                deps |= _with_parents(target, modules)
                for alias in node.names:  # ``from pkg import submodule``
                    deps |= {f"{target}.{alias.name}"} & modules.keys()
        deps.discard(name)
        # A package's own __init__ runs before its submodules, and is no cycle of theirs.
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_relative_nested_and_parent_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "dorylus"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("try:\n    from ..top import x\nexcept ImportError:\n    pass\n")
    (pkg / "top.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dorylus.typed\n"
                                "def f():\n    import dorylus.other\nimport dorylus.sub.leaf\n")
    (pkg / "other.py").write_text("from dorylus import top\n")
    (pkg / "typed.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("dorylus",))
    graph = import_graph()
    assert graph["dorylus.sub"] == {"dorylus.sub.leaf"}
    assert graph["dorylus.sub.leaf"] == {"dorylus.top"}
    assert graph["dorylus.top"] == {"dorylus.sub", "dorylus.sub.leaf"}
    assert find_cycle(graph) == ["dorylus.top", "dorylus.sub", "dorylus.sub.leaf", "dorylus.top"]
    everything = import_graph(deferred=True)
    assert everything["dorylus.top"] == {"dorylus.sub", "dorylus.sub.leaf", "dorylus.other"}
    assert find_cycle({**everything, "dorylus.sub.leaf": set()}) == ["dorylus.other", "dorylus.top", "dorylus.other"]


@pytest.mark.parametrize("deferred", [False, True], ids=["module-level", "with-deferred"])
def test_no_import_cycles(deferred):
    cycle = find_cycle(import_graph(deferred))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


ROLE_MODULES = {"graphserver": "graphserver.server", "paramserver": "dorylus.paramserver",
                "lambda-emulator": "dorylus.emulator.server"}


@pytest.mark.parametrize("role", [*ROLE_MODULES, None])
def test_a_command_imports_no_other_role(role):
    """``dorylus ROLE --help`` imports that role's module and no other role's (a role must not
    pay for the others' start-up); ``dorylus --help`` none, and neither imports torch."""
    code = (
        "import contextlib, io, sys\n"
        "from dorylus.cli import main\n"
        f"argv = {[role] if role else []!r} + ['--help']\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(argv)\n"
        f"print(sorted(m for m in {sorted(ROLE_MODULES.values())!r} + ['torch'] if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr([ROLE_MODULES[role]] if role else [])


@pytest.mark.parametrize("module", ["dorylus", "dorylus.cli"])
def test_help_lists_every_command(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    for command in ("train", "partition", "plan", "paramserver", "graphserver", "emulator"):
        assert command in result.stdout
