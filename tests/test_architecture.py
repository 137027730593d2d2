"""The layering of docs/architecture.md, checked on the source: imports only run down the
layers, none hides in a function to dodge a cycle, no module reads another one's private
attributes (TorchRec's and torch's privates go through ``dynemb/bridges/`` only), and the
services hold no storage-mode branch (each table class says how it saves itself)."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dynemb"

DOC = ROOT / "docs" / "architecture.md"


def documented_layers() -> List[Tuple[str, Tuple[str, ...]]]:
    """The layers of docs/architecture.md's table, bottom to top: ``(name, module
    prefixes)``. A module may import its own layer and those below; the longest matching
    prefix decides (``dynemb.kernels`` is the top-level ``kernels/`` folder, installed
    there)."""
    rows, in_table = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("| layer | modules"):
            in_table = True
        elif in_table and line.startswith("|---"):
            continue
        elif in_table and line.startswith("|"):
            name, modules = [cell.strip() for cell in line.strip("|").split("|")][:2]
            prefixes = tuple("dynemb" if m == "dynemb" else f"dynemb.{m}"
                             for m in re.findall(r"`([\w.]+)`", modules))
            rows.append((name, prefixes))
        elif in_table:
            break
    return rows[::-1]


LAYERS = documented_layers()

#: The TorchRec / torch internals dynemb relies on live here, each bridge tested against the
#: pinned versions.
BRIDGES = "dynemb.bridges"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> Iterator[Tuple[str, Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield module_name(path), path, ast.parse(path.read_text(), str(path))


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer of LAYERS: add it"
    return best


def dynemb_imports(tree: ast.Module, module: str) -> Iterator[Tuple[ast.stmt, str]]:
    """``(node, imported module)`` of every import of a dynemb module in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dynemb"):
                    yield node, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("dynemb"):
            for alias in node.names:  # "from dynemb.x import y" may import module x.y
                sub = f"{node.module}.{alias.name}"
                yield node, sub if _is_module(sub) else node.module


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    if name.startswith("dynemb.kernels"):
        path = ROOT.joinpath("kernels", *name.split(".")[2:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_module_has_a_layer():
    for module, _, _ in sources():
        layer_of(module)


def test_imports_only_run_down_the_layers():
    upward = []
    for module, path, tree in sources():
        mine = layer_of(module)
        for node, imported in dynemb_imports(tree, module):
            if imported.startswith("dynemb.kernels"):
                continue
            if layer_of(imported) > mine:
                upward.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module} "
                              f"({LAYERS[mine][0]}) imports {imported} "
                              f"({LAYERS[layer_of(imported)][0]})")
    assert not upward, "\n".join(upward)


def test_no_import_of_dynemb_hides_in_a_function():
    hidden = []
    for module, path, tree in sources():
        top = set(map(id, tree.body))
        for node, imported in dynemb_imports(tree, module):
            if imported.startswith("dynemb.kernels"):
                continue  # the CUDA kernels load when a CUDA backend is first asked for
            if id(node) not in top and not _under_type_checking(tree, node):
                hidden.append(f"{path.relative_to(ROOT)}:{node.lineno}: {imported}")
    assert not hidden, "\n".join(hidden)


def _under_type_checking(tree: ast.Module, node: ast.stmt) -> bool:
    for stmt in tree.body:
        if isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name) and \
                stmt.test.id == "TYPE_CHECKING" and node in ast.walk(stmt):
            return True
    return False


def test_the_module_graph_has_no_cycle():
    graph: Dict[str, Set[str]] = {}
    for module, _, tree in sources():
        deps = graph.setdefault(module, set())
        deps.update(imported for _, imported in dynemb_imports(tree, module)
                    if not imported.startswith("dynemb.kernels"))
        parent = module.rpartition(".")[0]
        if parent:  # importing a submodule runs its package first
            deps.add(parent)
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep == node or dep.startswith(node + "."):
                continue  # a package importing its own submodules
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _private_names_defined(tree: ast.Module) -> Set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_")}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_reads_another_ones_private_attributes():
    crossings = []
    for module, path, tree in sources():
        if module == BRIDGES or module.startswith(BRIDGES + "."):
            continue
        own = _private_names_defined(tree)
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                receiver = node.value
                if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                    continue
                if node.attr in own and not (isinstance(receiver, ast.Name)
                                             and receiver.id in ("torch", "torchrec")):
                    continue  # a private name of this file (e.g. a sibling class's)
                crossings.append(f"{where}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if _is_private(alias.name):
                        crossings.append(f"{where}: import {node.module}.{alias.name}")
    assert not crossings, "\n".join(crossings)


@pytest.mark.parametrize("package", ["checkpoint", "stashing", "serving"])
def test_services_hold_no_storage_mode_branch(package):
    branches = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if "StorageMode." in line and not line.lstrip().startswith(("#", ">>>")):
                branches.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not branches, "\n".join(branches)


def test_the_documented_layers_are_the_eight_of_the_picture():
    assert [name for name, _ in LAYERS] == [
        "kernels", "foundations", "hash table and rows", "tables", "services", "modules",
        "distribution", "package"]
    assert (ROOT / "docs" / "architecture.png").exists()


#: What tells a group from a table: the layers above the tables see neither (they see a
#: ``tables.lookup_batch.LookupBatch`` and the units of ``tables.units``).
_KINDS = ("GroupBatch", "TableBatch", "TableGroup", "LoneTable")


def test_above_the_tables_nothing_tells_a_group_from_a_table():
    tables = [name for name, _ in LAYERS].index("tables")
    telling = []
    for module, path, tree in sources():
        if layer_of(module) <= tables:
            continue
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
                named = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", None)
                         for n in ast.walk(node.args[1])}
                telling.extend(f"{where}: isinstance(..., {kind})"
                               for kind in sorted(named.intersection(_KINDS)))
            elif isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("dynemb"):
                telling.extend(f"{where}: imports {alias.name}" for alias in node.names
                               if alias.name in ("GroupBatch", "LoneTable"))
    assert not telling, "\n".join(telling)
