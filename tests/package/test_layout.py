"""The package's layout: every import counted (module level, inside functions, under
TYPE_CHECKING), no cycle among the product's modules, no arrow from a lower layer to a
higher one, and no import of the lab (`oppo_lab`) from the product. See docs/design.md, "Layout"."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "openrlhf_oppo"
LAB = "oppo_lab"  # the studies' package: the product never imports it

# Lowest first. A module may import its own layer and the ones below, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("openrlhf_oppo", "openrlhf_oppo.settings", "openrlhf_oppo.run_env", "openrlhf_oppo.upstream",
     "openrlhf_oppo.timeline", "openrlhf_oppo.hooks", "openrlhf_oppo.footprint"),
    ("openrlhf_oppo.config",),
    ("openrlhf_oppo.core",),
    ("openrlhf_oppo.models",),
    ("openrlhf_oppo.compat",),
    ("openrlhf_oppo.megatron",),
    ("openrlhf_oppo.tasks",),
    ("openrlhf_oppo.integrations", "openrlhf_oppo.integrations.runtime"),
    ("openrlhf_oppo.integrations.launch",),
    ("openrlhf_oppo.bench",),
    ("openrlhf_oppo.sim",),
    ("openrlhf_oppo.cli",),
)


def product_modules(package: Path = PACKAGE) -> dict[str, Path]:
    mods = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _targets(module: str, is_package: bool, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
    out = []
    for name in names:
        while name and name not in mods:  # `a.b.Name` -> the module `a.b`
            name = name.rpartition(".")[0]
        if name.startswith("openrlhf_oppo"):
            out.append(name)
    return out


def _imported_names(module: str, is_package: bool, node: ast.AST) -> list[str]:
    """The absolute module names an import statement names (a relative one resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not node.level:
        return [node.module or ""]
    parts = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
    parts = parts[: len(parts) - (node.level - 1)]
    return [".".join(parts + ([node.module] if node.module else []))]


def lab_imports(package: Path = PACKAGE) -> list[str]:
    """`module -> name` for every import of the lab anywhere in the product's source."""
    found = []
    for module, path in sorted(product_modules(package).items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{module} -> {name}" for name in _imported_names(module, path.name == "__init__.py", node)
                          if name == LAB or name.startswith(LAB + ".")]
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the product modules it imports anywhere in its source."""
    mods = product_modules(package)
    graph = {}
    for module, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(module, path.name == "__init__.py", node, mods))
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    """The layer of the longest prefix in LAYERS naming `module` or a package above it
    (the root package `openrlhf_oppo` names only itself)."""
    matches = [(len(prefix), rank) for rank, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or (prefix != "openrlhf_oppo" and module.startswith(prefix + "."))]
    if not matches:
        raise KeyError(f"{module} is in no layer of tests/package/test_layout.py: add it to LAYERS")
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} (layer {layer_of(m)}) -> {t} (layer {layer_of(t)})"
                  for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def test_no_import_cycle_among_product_modules():
    assert cycles(import_graph()) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    assert upward_imports(import_graph()) == []


def test_every_product_module_has_a_layer():
    for module in product_modules():
        layer_of(module)


def test_the_product_never_imports_the_lab():
    assert lab_imports() == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """The checks above can fail: a cycle, a function-level upward import, a
    TYPE_CHECKING import and imports of the lab in a throwaway package are all found."""
    pkg = tmp_path / "openrlhf_oppo"
    (pkg / "core").mkdir(parents=True)
    (pkg / "cli").mkdir()
    for init in (pkg, pkg / "core", pkg / "cli"):
        (init / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from openrlhf_oppo.core import b\n")
    (pkg / "core" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from openrlhf_oppo.core.a import X\n"
        "def f():\n    from openrlhf_oppo.cli import main\n"
    )
    (pkg / "cli" / "main.py").write_text("from . import helper\n")
    (pkg / "cli" / "helper.py").write_text("")
    (pkg / "cli" / "lab_user.py").write_text("def f():\n    import oppo_lab.sim.calibrate\n")
    (pkg / "core" / "c.py").write_text("from oppo_lab import schedules\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["openrlhf_oppo.core.a", "openrlhf_oppo.core.b"]]
    assert lab_imports(pkg) == ["openrlhf_oppo.cli.lab_user -> oppo_lab.sim.calibrate",
                                "openrlhf_oppo.core.c -> oppo_lab"]
    assert upward_imports(graph) == ["openrlhf_oppo.core.b (layer 2) -> openrlhf_oppo.cli.main (layer 11)"]
    assert graph["openrlhf_oppo.cli.main"] == {"openrlhf_oppo.cli.helper"}


@pytest.mark.parametrize("module", ["openrlhf_oppo.core.scheduler", "openrlhf_oppo.sim.cli", "openrlhf_oppo.config"])
def test_layer_of_names_the_package_layer(module):
    assert 0 < layer_of(module) < len(LAYERS)
