"""The layering of docs/architecture.md, checked on the source: imports only run down the
layers, none hides in a function to dodge a cycle, no module reads another one's private
attributes (TorchRec's and torch's privates go through ``dynemb/bridges/`` only), and no
storage mode is named outside the tables layer and the options (everything else asks the
mode's policy, :mod:`dynemb.tables.policies`)."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Set, Tuple

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


def test_at_most_three_modules_import_the_kernels():
    """Every kernel launch goes through the ``KernelBackend`` protocol: the protocol module
    (the kernels' codes), the CPU and the CUDA backend import ``dynemb.kernels``, nothing
    else."""
    importers = sorted({str(path.relative_to(ROOT)) for module, path, tree in sources()
                        for _, imported in dynemb_imports(tree, module)
                        if imported.startswith("dynemb.kernels")})
    assert len(importers) <= 3, "modules importing dynemb.kernels:\n" + "\n".join(importers)


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


#: Where a storage mode may be named: the options choose it, the tables layer implements it
#: (and holds its policy, :mod:`dynemb.tables.policies`, which everything else asks).
STORAGE_MODE_HOMES = ("dynemb/tables/", "dynemb/options.py")


def storage_mode_members(tree: ast.Module) -> Iterator[ast.expr]:
    """Expressions of ``tree`` that name one member of ``StorageMode``:
    ``StorageMode.CACHE`` (also through ``dynemb.options.StorageMode`` or an ``import ... as``
    alias), ``StorageMode["CACHE"]`` or ``StorageMode("cache")``. Docstrings are strings: a
    doctest's output may show a member."""
    names = {"StorageMode"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(alias.asname for alias in node.names
                         if alias.name == "StorageMode" and alias.asname)

    def is_enum(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or (
            isinstance(node, ast.Attribute) and node.attr == "StorageMode")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_enum(node.value) and \
                not node.attr.startswith("_"):
            yield node
        elif isinstance(node, ast.Subscript) and is_enum(node.value) and \
                isinstance(node.slice, ast.Constant):
            yield node
        elif isinstance(node, ast.Call) and is_enum(node.func) and \
                any(isinstance(arg, ast.Constant) for arg in node.args):
            yield node


def test_no_storage_mode_is_named_outside_the_tables_and_the_options():
    """A mode's meaning to the rest of dynemb is its storage policy: code outside the tables
    layer and the options asks ``storage_policy(layout.mode)``, never tests for a mode."""
    named = []
    for _, path, tree in sources():
        where = path.relative_to(ROOT).as_posix()
        if where.startswith(STORAGE_MODE_HOMES):
            continue
        named.extend(f"{where}:{node.lineno}: {ast.unparse(node)}"
                     for node in sorted(storage_mode_members(tree), key=lambda n: n.lineno))
    assert not named, "\n".join(named)


def test_the_storage_mode_check_sees_every_spelling():
    tree = ast.parse("from dynemb.options import StorageMode as Mode\n"
                     "import dynemb.options\n"
                     "a = x.mode is StorageMode.CACHE\n"
                     "b = Mode.HOST_ONLY\n"
                     "c = dynemb.options.StorageMode.DEFAULT\n"
                     "d = StorageMode['HBM_DIRECT']\n"
                     "e = StorageMode('cache')\n"
                     "f = tuple(StorageMode), StorageMode(value), StorageMode.__members__\n")
    assert sorted(node.lineno for node in storage_mode_members(tree)) == [3, 4, 5, 6, 7]


def test_the_documented_layers_are_the_eight_of_the_picture():
    assert [name for name, _ in LAYERS] == [
        "kernels", "foundations", "hash table and rows", "tables", "services", "modules",
        "distribution", "package"]
    assert (ROOT / "docs" / "architecture.png").exists()


#: The top of the package holds its public face; each layer's code lives in its folder.
MOST_MODULES_AT_THE_TOP = 15


def test_the_top_of_the_package_holds_only_its_public_face():
    top = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert len(top) <= MOST_MODULES_AT_THE_TOP, \
        f"{len(top)} modules directly in dynemb/ (at most {MOST_MODULES_AT_THE_TOP}): {top}"


def test_every_folder_of_the_package_lies_in_one_layer():
    """A folder is a layer's (or part of one): no module of it is listed in another layer."""
    for folder in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        package = module_name(folder / "__init__.py")
        layers = {LAYERS[layer_of(module)][0] for module, path, _ in sources()
                  if module == package or module.startswith(package + ".")}
        assert len(layers) == 1, f"{package} spans the layers {sorted(layers)}"


# -- private state: a class reads what it or its bases set -----------------------------------
class PrivateRead(NamedTuple):
    """One read of ``self._name`` in a method of ``owner`` (``module.Class``)."""

    owner: str
    attr: str
    path: str
    lineno: int


class ClassFacts(NamedTuple):
    module: str
    path: str
    node: ast.ClassDef
    #: private names the class itself sets or defines
    sets: FrozenSet[str]
    #: its bases: dynemb classes (``module.Class``) and the others (as written)
    bases: Tuple[str, ...]
    outside_bases: Tuple[str, ...]


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _holds_fields(node: ast.ClassDef) -> bool:
    """Whether a bare annotation in the body of ``node`` declares a field (a dataclass or a
    NamedTuple) rather than only a type."""
    decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
    return any("dataclass" in ast.unparse(d) for d in decorators) or \
        any(ast.unparse(b).endswith("NamedTuple") for b in node.bases)


def _methods(node: ast.ClassDef) -> Iterator[ast.AST]:
    """The nodes of ``node``'s methods (nested functions included, nested classes not)."""
    def walk(tree: ast.AST) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(tree):
            if not isinstance(child, ast.ClassDef):
                yield child
                yield from walk(child)
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield stmt
            yield from walk(stmt)


def names_a_class_sets(node: ast.ClassDef) -> Set[str]:
    """What a class defines or assigns itself: its methods, properties and class attributes,
    its fields (dataclass, NamedTuple) and ``__slots__``, and whatever its methods store on
    ``self`` (``self._x = ...``, ``setattr(self, "_x", ...)``, ``object.__setattr__``)."""
    names: Set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                if isinstance(target, ast.Name) and target.id == "__slots__":
                    names.update(c.value for c in ast.walk(stmt.value)
                                 if isinstance(c, ast.Constant) and isinstance(c.value, str))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and \
                (stmt.value is not None or _holds_fields(node)):
            names.add(stmt.target.id)
    for sub in _methods(node):
        if isinstance(sub, ast.Attribute) and _is_self(sub.value) and \
                isinstance(sub.ctx, ast.Store):
            names.add(sub.attr)
        elif isinstance(sub, ast.Call) and len(sub.args) >= 2 and _is_self(sub.args[0]) and \
                isinstance(sub.args[1], ast.Constant) and ast.unparse(sub.func) in (
                    "setattr", "object.__setattr__", "super().__setattr__"):
            names.add(sub.args[1].value)
    return names


def private_reads(facts: ClassFacts, name: str) -> Iterator[PrivateRead]:
    for sub in _methods(facts.node):
        if isinstance(sub, ast.Attribute) and _is_self(sub.value) and \
                isinstance(sub.ctx, ast.Load) and _is_private(sub.attr):
            yield PrivateRead(name, sub.attr, facts.path, sub.lineno)


def class_facts(modules: Dict[str, Tuple[str, ast.Module]]) -> Dict[str, ClassFacts]:
    """Every class of ``modules`` (``{module: (path, tree)}``) by ``module.Class``, its bases
    followed through ``from dynemb... import`` (and the packages' re-exports)."""
    found: Dict[str, ast.ClassDef] = {}
    for module, (_, tree) in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found.setdefault(f"{module}.{node.name}", node)

    def resolve(module: str, name: str, depth: int = 0) -> Optional[str]:
        if f"{module}.{name}" in found:
            return f"{module}.{name}"
        if module not in modules or depth > 8:
            return None
        for node in modules[module][1].body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return resolve(node.module, alias.name, depth + 1)
        return None

    facts = {}
    for qualified, node in found.items():
        module = qualified.rsplit(".", 1)[0]
        inside, outside = [], []
        for base in node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            resolved = resolve(module, base.id) if isinstance(base, ast.Name) else None
            (inside if resolved else outside).append(resolved or ast.unparse(base))
        facts[qualified] = ClassFacts(module, modules[module][0], node,
                                      frozenset(names_a_class_sets(node)), tuple(inside),
                                      tuple(outside))
    return facts


def _ancestry(facts: Dict[str, ClassFacts], name: str) -> List[str]:
    """``name`` and its dynemb bases, all the way up."""
    seen, todo = [], [name]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.append(current)
            todo.extend(facts[current].bases)
    return seen


#: Bases outside dynemb that hold no state a subclass could read.
STATELESS_BASES = ("object", "ABC", "abc.ABC", "Protocol", "Generic", "typing.Protocol",
                   "enum.Enum", "NamedTuple", "typing.NamedTuple", "Exception", "ValueError",
                   "RuntimeError")


def reaching_back(modules: Dict[str, Tuple[str, ast.Module]]) -> List[Tuple[PrivateRead, str]]:
    """``(read, why)`` of every ``self._x`` a class reads though neither it nor any of its
    bases sets ``_x``: set by a subclass (a mixin reaching back into its host), or by a base
    outside dynemb (torch's or TorchRec's private state, which only ``dynemb/bridges/`` may
    read)."""
    facts = class_facts(modules)
    found = []
    for name, fact in facts.items():
        ancestry = _ancestry(facts, name)
        sets = set().union(*(facts[c].sets for c in ancestry))
        outside = sorted({b for c in ancestry for b in facts[c].outside_bases}
                         - set(STATELESS_BASES))
        bridged = fact.module == BRIDGES or fact.module.startswith(BRIDGES + ".")
        for read in private_reads(fact, name):
            if read.attr in sets or (bridged and outside):
                continue
            setters = sorted(c for c, f in facts.items()
                             if read.attr in f.sets and name in _ancestry(facts, c))
            why = (f"set only by its subclass {', '.join(setters)}" if setters else
                   f"set by no class of dynemb it is (bases outside: {', '.join(outside)})"
                   if outside else "set by no class it is")
            found.append((read, why))
    return found


def reads_set_in_another_file(modules: Dict[str, Tuple[str, ast.Module]]) -> List[PrivateRead]:
    """The ``self._x`` reads of a file whose ``_x`` only other files set."""
    facts = class_facts(modules)
    set_in: Dict[str, Set[str]] = {}
    for fact in facts.values():
        for attr in fact.sets:
            set_in.setdefault(attr, set()).add(fact.path)
    return [read for name, fact in facts.items() for read in private_reads(fact, name)
            if set_in.get(read.attr) and fact.path not in set_in[read.attr]]


def package_modules() -> Dict[str, Tuple[str, ast.Module]]:
    return {module: (path.relative_to(ROOT).as_posix(), tree)
            for module, path, tree in sources()}


def test_no_class_reads_private_state_only_a_subclass_sets():
    """A class reads the private state it or its bases set, never what only a subclass
    defined elsewhere sets: such a mixin works only inside its host and hides a dependency
    the import graph does not show. Compose an object over an explicit record instead."""
    modules = package_modules()
    offenders = reaching_back(modules)
    across = reads_set_in_another_file(modules)
    print(f"\nself._x reads whose _x only another file sets: {len(across)}")
    assert not offenders, f"{len(offenders)} reads of private state a class does not own:\n" + \
        "\n".join(f"{read.path}:{read.lineno}: {read.owner} reads self.{read.attr}, {why}"
                  for read, why in offenders)


def test_the_private_state_check_tells_a_mixin_from_a_subclass():
    host = ast.parse(
        "from dynemb.mixin import Images\n"
        "import dataclasses\n"
        "class Table(Images):\n"
        "    __slots__ = ('_slotted',)\n"
        "    _counter = 0\n"
        "    def __init__(self):\n"
        "        self._arrays = []\n"
        "        setattr(self, '_named', 1)\n"
        "    def _grow(self):\n"
        "        return self._arrays, self._slotted, self._named, self._counter, self._image()\n"
        "@dataclasses.dataclass\n"
        "class Record:\n"
        "    _rows: int\n"
        "    def rows(self):\n"
        "        return self._rows\n"
        "class Typed:\n"
        "    _rows: int\n"
        "    def rows(self):\n"
        "        return self._rows\n")
    mixin = ast.parse(
        "class Images:\n"
        "    def _image(self):\n"
        "        return list(self._arrays)\n"
        "    def grown(self):\n"
        "        return self._grow()\n")
    modules = {"dynemb.host": ("host.py", host), "dynemb.mixin": ("mixin.py", mixin)}
    found = sorted((read.owner, read.attr, why) for read, why in reaching_back(modules))
    assert found == [
        ("dynemb.host.Typed", "_rows", "set by no class it is"),
        ("dynemb.mixin.Images", "_arrays", "set only by its subclass dynemb.host.Table"),
        ("dynemb.mixin.Images", "_grow", "set only by its subclass dynemb.host.Table")]
    assert sorted((r.owner, r.attr) for r in reads_set_in_another_file(modules)) == [
        ("dynemb.host.Table", "_image"), ("dynemb.mixin.Images", "_arrays"),
        ("dynemb.mixin.Images", "_grow")]


#: What tells a group from a table: the layers above the tables see neither (they see a
#: ``tables.lookup_batch.LookupBatch`` and the groups ``tables.groups`` makes).
_KINDS = ("GroupBatch", "TableBatch", "TieredBatch", "TableGroup", "TieredGroup")


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
                               if alias.name in ("GroupBatch", "TieredBatch"))
    assert not telling, "\n".join(telling)


def test_nothing_keeps_pickles_of_earlier_commits_loading():
    """dynemb is unreleased: a module pickled whole by an earlier commit need not load, so
    nothing serves one (no import hook for old module paths, no module ``__getattr__`` for
    old names, no branch for state an earlier version pickled). Checkpoints carry their own
    format versions (docs/checkpoint.md)."""
    import importlib.util
    import sys

    import dynemb  # noqa: F401  (what importing the package installs)
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("dynemb")]
    assert importlib.util.find_spec("dynemb.collection") is None  # an old module path
    for module, path, tree in sources():
        assert not [node.name for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"], module
        found = re.search(r"earlier version|pickled by an earlier|pickled before",
                          path.read_text(), re.IGNORECASE)
        assert found is None, f"{module}: {found and found.group(0)}"
