"""Architecture rules, checked on the source: the import graph of `paratrain` has no cycle, no module reaches into
another module's private names, a mode's strings are compared in its owners only (paratrain/modes.py,
paratrain/layout.py, a capability module for its own section's), the layout is light, and no module but the error path catches BaseException.

The graph is read with `ast`, not by importing: an edge A -> B for every `import` / `from ... import` in A (at
module level or inside a function: a lazy import still ties the two together), and for every string literal in A
that is exactly the name of a paratrain module (`importlib.import_module("paratrain.x")`, tables of such names
like cli.py's LAZY_COMMANDS, `__import__("paratrain.x")`) or names one of its attributes as "paratrain.x:attr" (a
model family's `module`: imported later by importlib). Importing `paratrain.a.b`
counts as an edge to `paratrain.a.b` only, not to the packages above it (Python has those half-initialised already,
so they do not make a cycle).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "paratrain"
# Where rule (b) looks for importers: the package, the tests and the benchmarks. cli.py is the exception.
IMPORTERS = (PACKAGE, ROOT / "tests", ROOT / "bench")
PRIVATE_IMPORTS_ALLOWED_IN = {PACKAGE / "cli.py"}


def module_name(path: Path) -> str:
    """paratrain/a/b.py -> paratrain.a.b; paratrain/a/__init__.py -> paratrain.a; tests/x.py -> tests.x."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


MODULES: dict[str, Path] = {module_name(p): p for p in python_files(PACKAGE)}


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def is_package(name: str) -> bool:
    return name in MODULES and MODULES[name].name == "__init__.py"


def absolute_from(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import ...` names, resolving relative imports against the importer."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    how: str  # the import statement or string, for the failure message

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({MODULES[self.source].relative_to(ROOT)}:{self.line}: {self.how})"


def attribute_module(value: str) -> str | None:
    """The paratrain module a "module:attr" string names one attribute of (a function or class imported later by
    importlib; an f-string's first part may end at the colon), else None."""
    module, colon, attr = value.partition(":")
    return module if colon and module in MODULES and (not attr or attr.isidentifier()) else None


def imported_modules(importer: str, tree: ast.Module):
    """(target module, line, how) for every paratrain module `importer` loads, by statement or by name string."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            module = absolute_from(importer, node)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in MODULES:  # `from paratrain.x import y` where y is a submodule
                    yield sub, node.lineno, f"from {module} import {alias.name}"
                elif module in MODULES:
                    yield module, node.lineno, f"from {module} import {alias.name}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            yield node.value, node.lineno, repr(node.value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and attribute_module(node.value):
            yield attribute_module(node.value), node.lineno, repr(node.value)


def import_graph() -> dict[str, list[Edge]]:
    graph: dict[str, list[Edge]] = {name: [] for name in MODULES}
    for name, path in MODULES.items():
        seen = set()
        for target, line, how in imported_modules(name, parse(path)):
            if target != name and target not in seen:
                seen.add(target)
                graph[name].append(Edge(name, target, line, how))
    return graph


def cycles(graph: dict[str, list[Edge]]) -> list[tuple[set[str], list[Edge]]]:
    """For each strongly connected component of more than one module (Tarjan): its modules and one shortest cycle
    through it, as edges."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:  # recursive: the package has ~60 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:
        start = min(component)
        # breadth-first inside the component: the shortest way from `start` back to itself
        paths, queue = {start: []}, [start]
        while queue:
            v = queue.pop(0)
            for e in graph[v]:
                if e.target not in component:
                    continue
                if e.target == start:
                    found.append((component, paths[v] + [e]))
                    queue = []
                    break
                if e.target not in paths:
                    paths[e.target] = paths[v] + [e]
                    queue.append(e.target)
    return found


def test_import_graph_has_no_cycle():
    found = cycles(import_graph())
    text = "\n\n".join(f"modules that import each other: {', '.join(sorted(component))}; a cycle:\n"
                       + " ->\n".join(f"  {e}" for e in cycle) for component, cycle in found)
    assert not found, f"{len(found)} import cycle(s) in paratrain:\n{text}"


def test_cycle_finder_sees_function_level_and_string_edges():
    """The detector itself: a lazy import inside a function and a module name in a string table both count."""
    tree_a = ast.parse("def f():\n    from paratrain.errors import UserError\n")
    tree_b = ast.parse("TABLE = {'x': ('paratrain.cli', 'main')}\n")
    tree_c = ast.parse("TABLE = {'x': 'paratrain.cli:main', 'y': f'paratrain.api:{z}', 'w': 'paratrain.cli: no'}\n")
    assert [t for t, *_ in imported_modules("paratrain.config", tree_a)] == ["paratrain.errors"]
    assert [t for t, *_ in imported_modules("paratrain.errors", tree_b)] == ["paratrain.cli"]
    assert sorted(t for t, *_ in imported_modules("paratrain.errors", tree_c)) == ["paratrain.api", "paratrain.cli"]
    graph = {"paratrain.config": [Edge("paratrain.config", "paratrain.errors", 2, "lazy")],
             "paratrain.errors": [Edge("paratrain.errors", "paratrain.config", 1, "string")]}
    assert [[e.target for e in c] for _, c in cycles(graph)] == [["paratrain.errors", "paratrain.config"]]


# -- functions named by string --------------------------------------------------------------------------------
# Builders are imported (the optimizers' in training/optim.py's BUILDERS, beside the code that calls them; a
# capability's optimizer's from its torch module, training/muon.py's). The one
# kind of name a torch-free table keeps for torch-side code is a model family's `module` ("module:Class" in its
# ModelFamily declaration, models/family.py): the family's parameter table is read by the estimator and the planner
# without torch, and a plug-in family outside paratrain is registered the same way. The import graph above counts
# each such string as an import (so a cycle through it fails the cycle tests); nothing else in paratrain/ names a
# paratrain module's attribute by string.
FAMILY_MODULE = (("ModelFamily", "SideHead"), "module")  # the keyword of a family's (or side head's) declaration
# that names its nn.Module


def named_attribute_strings(tree: ast.Module, allowed_table: str | None = None) -> list[tuple[int, str]]:
    """(line, string) for each string (or f-string's first part) naming a paratrain module's attribute
    ("paratrain.x:attr"), outside the dict assigned to `allowed_table` and the `module=` of ModelFamily(...) calls."""
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and allowed_table is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == allowed_table for t in targets) and node.value is not None:
                allowed |= {id(n) for n in ast.walk(node.value)}
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in \
                FAMILY_MODULE[0]:
            allowed |= {id(n) for k in node.keywords if k.arg == FAMILY_MODULE[1] for n in ast.walk(k.value)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and attribute_module(node.value) and id(node) not in allowed)


def test_every_optimizer_has_an_imported_builder():
    """training/optim.py's BUILDERS: a callable for every registered optimizer, imported (not named)."""
    from paratrain.capabilities import OPTIMIZERS
    from paratrain.training.optim import BUILDERS

    assert set(BUILDERS) == set(OPTIMIZERS), f"optimizers without a builder or builders without an optimizer: " \
                                             f"{sorted(set(BUILDERS) ^ set(OPTIMIZERS))}"
    assert all(callable(b) for b in BUILDERS.values())


def test_every_family_module_resolves_and_is_an_import_edge():
    """Each built-in family's `module` imports and names a class, and the import graph sees it (an edge from the
    module that declares the family)."""
    from paratrain.models.registry import BUILTIN, get_family

    graph = import_graph()
    for name in BUILTIN:
        family = get_family(name)
        module, _, cls = family.module.partition(":")
        assert isinstance(getattr(importlib.import_module(module), cls, None), type), family.module
        declaring = [m for m, edges in graph.items() if any(e.target == module and ":" in e.how for e in edges)]
        assert declaring, f"no import edge to {module} from the family {name}'s declaration"


def test_no_function_is_named_by_string_outside_the_families():
    """No "paratrain.x:attr" string in paratrain/ but a model family's (or side head's) `module`."""
    found = [f"{p.relative_to(ROOT)}:{line}: {value!r}" for p in python_files(PACKAGE)
             for line, value in named_attribute_strings(parse(p))]
    assert not found, ("a paratrain module's attribute named by a \"module:attr\" string outside the model families' "
                       "`module` (import it instead):\n" + "\n".join(found))


def test_named_attribute_finder():
    source = ("BUILDERS = {'a': 'paratrain.cli:main'}\n"
              "OTHER = {'a': 'paratrain.cli:main'}\n"
              "F = ModelFamily(name='x', module=f'paratrain.api:{c}')\n"
              "G = ModelFamily(name='paratrain.api:train')\n"
              "H = 'paratrain.nowhere:x', 'paratrain.cli', 'see paratrain.cli: main'\n")
    assert named_attribute_strings(ast.parse(source), "BUILDERS") == [(2, "paratrain.cli:main"),
                                                                      (4, "paratrain.api:train")]


# -- packages --------------------------------------------------------------------------------------------------
# A package is each subpackage of paratrain (data, distributed, estimate, hf, models, observe, training, commands,
# ...) and each top-level module (api, config, layout, modes, spec, preflight, faults, inference, generate, verify,
# cli, ...). Their graph has no cycle either: each function lives in the layer of what it needs (a command's
# orchestration in paratrain/commands/), or takes a value or a callable from above instead of importing it.


def package_of(module: str) -> str | None:
    """paratrain.a.b.c -> paratrain.a; paratrain.x -> paratrain.x; paratrain (the root) -> None."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else None


@dataclass(frozen=True)
class PackageEdge:
    source: str
    target: str
    via: Edge  # one module import that makes the edge (the first found)

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  (e.g. {self.via})"


def package_graph(graph: dict[str, list[Edge]]) -> dict[str, list[PackageEdge]]:
    packages: dict[str, dict[str, Edge]] = {}
    for name in sorted(graph):
        source = package_of(name)
        if source is None:
            continue
        out = packages.setdefault(source, {})
        for e in graph[name]:
            target = package_of(e.target)
            if target not in (None, source) and target not in out:
                out[target] = e
    for target in {t for out in packages.values() for t in out}:
        packages.setdefault(target, {})
    return {p: [PackageEdge(p, t, e) for t, e in sorted(out.items())] for p, out in packages.items()}


def describe_cycles(found) -> str:
    return "\n\n".join(f"packages that import each other: {', '.join(sorted(component))}; a cycle:\n"
                        + " ->\n".join(f"  {e}" for e in cycle) for component, cycle in found)


def test_packages_have_no_import_cycle():
    """Imports at module level, inside functions, relative ones and `importlib` loads of a paratrain module named
    in a string all count."""
    found = cycles(package_graph(import_graph()))
    assert not found, f"{len(found)} import cycle(s) between the packages of paratrain:\n{describe_cycles(found)}"


def test_package_graph_sees_every_kind_of_import():
    trees = {"paratrain.observe.replay": "def f():\n    from paratrain.api import train\n",
             "paratrain.api": "from .training import loop\n",
             "paratrain.training.loop": "import importlib\nm = importlib.import_module('paratrain.observe.hang')\n",
             "paratrain.observe.hang": "from . import replay\n"}
    graph = {name: [Edge(name, target, line, how) for target, line, how in imported_modules(name, ast.parse(src))]
             for name, src in trees.items()}
    graph.update({t: [] for edges in list(graph.values()) for t in (e.target for e in edges) if t not in graph})
    found = cycles(package_graph(graph))
    assert len(found) == 1 and found[0][0] == {"paratrain.api", "paratrain.observe", "paratrain.training"}, found


# -- imports inside functions ----------------------------------------------------------------------------------
# An import of paratrain or torch belongs at module level, unless loading it later is the point: `paratrain --help`
# and the error paths stay fast (torch is not imported for them), or an optional dependency is loaded. Such an
# import says why in a comment on its line or the line above, containing one of these markers.
LAZY_MARKERS = ("lazy:", "optional:")


def unexplained_lazy_imports(tree: ast.Module, lines: list[str], where, importer: str = "") -> list[str]:
    """`import torch` / `from paratrain... import` inside a function without a LAZY_MARKERS comment. The comment is
    on the statement's lines or the line above; one above a run of consecutive import statements covers them all."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        explained = False  # the previous statement of this body is an import that says why
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                said = lines[max(0, child.lineno - 2):child.end_lineno]
                explained = explained or any(m in line for line in said for m in LAZY_MARKERS)
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    names = [absolute_from(importer, child) if child.level else child.module or ""]
                if any(n.split(".")[0] in ("paratrain", "torch") for n in names) and not explained:
                    found.append(f"{where}:{child.lineno}: {lines[child.lineno - 1].strip()}")
            else:
                explained = False
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def lazy_import_report() -> list[str]:
    """Every unexplained in-function import of paratrain/."""
    found = []
    for path in python_files(PACKAGE):
        text = path.read_text()
        found += unexplained_lazy_imports(ast.parse(text), text.splitlines(), path.relative_to(ROOT), module_name(path))
    return found


def test_imports_inside_functions_say_why():
    found = lazy_import_report()
    assert not found, (f"imports of paratrain or torch inside a function: move them to the top of the module, or say "
                       f"why they wait with a comment containing {' or '.join(LAZY_MARKERS)} (on the line or above):\n"
                       + "\n".join(found))


def test_lazy_import_finder():
    source = ("import torch\n"
              "def f():\n"
              "    import torch\n"
              "    import json\n"
              "    # lazy: --help must not load torch\n"
              "    from paratrain.api import train\n"
              "    from . import x\n"
              "    from paratrain.models import (\n"
              "        build_model)  # optional: never\n"
              "    from paratrain import modes  # optional: tensorboard\n"
              "    import paratrain.layout\n"  # (in the run under the comment above)
              "    x = 1\n"
              "    from . import spec\n")
    found = unexplained_lazy_imports(ast.parse(source), source.splitlines(), "x.py", "paratrain.y")
    assert found == ["x.py:3: import torch", "x.py:13: from . import spec"], found


# -- private names -----------------------------------------------------------------------------------------------

def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path) -> list[str]:
    """`from paratrain.x import _y` and `paratrain.x._y` (through an imported module) in one file."""
    return find_private_uses(module_name(path), parse(path), path.relative_to(ROOT))


def find_private_uses(importer: str, tree: ast.Module, where) -> list[str]:
    found = []
    bound: dict[str, str] = {}  # local name -> paratrain module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("paratrain"):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["paratrain"] = "paratrain"
        elif isinstance(node, ast.ImportFrom):
            module = absolute_from(importer, node)
            if module != "paratrain" and not module.startswith("paratrain."):
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in MODULES:
                    bound[alias.asname or alias.name] = sub
                elif is_private(alias.name) and module != importer:
                    found.append(f"{where}:{node.lineno}: {importer} imports {module}.{alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in bound:
            continue
        module, i = bound[base.id], 0
        while i < len(chain) and f"{module}.{chain[i]}" in MODULES:  # paratrain.x.y: walk down to the module
            module, i = f"{module}.{chain[i]}", i + 1
        if i < len(chain) and is_private(chain[i]) and module != importer:
            found.append(f"{where}:{node.lineno}: {importer} uses {module}.{chain[i]}")
    return sorted(set(found))


def test_no_private_names_from_other_modules():
    found = [line for folder in IMPORTERS for path in python_files(folder)
             if path not in PRIVATE_IMPORTS_ALLOWED_IN for line in private_uses(path)]
    assert not found, "private names used across modules (make them public or move them):\n" + "\n".join(found)


def test_private_finder_sees_imports_and_attributes():
    source = ("from paratrain.cli import _rank_main, main\n"
              "import paratrain.models.moe\n"
              "from paratrain.models import moe as m\n"
              "def f(monkeypatch):\n"
              "    monkeypatch.setattr(paratrain.models.moe, 'x', paratrain.models.moe._use_grouped_mm)\n"
              "    return m._use_grouped_mm, m.MoE, m.__name__\n")
    found = find_private_uses("tests.x", ast.parse(source), "tests/x.py")
    assert found == ["tests/x.py:1: tests.x imports paratrain.cli._rank_main",
                     "tests/x.py:5: tests.x uses paratrain.models.moe._use_grouped_mm",
                     "tests/x.py:6: tests.x uses paratrain.models.moe._use_grouped_mm"]


# -- modes -----------------------------------------------------------------------------------------------------------
# Where a mode's string may be compared: paratrain/modes.py (the choices, and the questions about one mode) and
# paratrain/layout.py (the rules about a layout), and a capability module (the modes of its own section: fp8's
# recipe and compute). Everyone else asks their predicates.
MODE_OWNERS = {PACKAGE / "modes.py", PACKAGE / "layout.py", *(PACKAGE / "capabilities").glob("*.py")}
MODE_SCANNED = (PACKAGE, ROOT / "bench")
MODE_TYPES = ("DPModeOption", "Schedule", "CheckpointMode", "Precision", "GradCompression", "WeightDtype",
              "Float8Compute")  # (Float8Recipe's "rowwise" is also a tensor-parallel role: its predicate is fp8's)
# a mode type declared in its capability module
CAPABILITY_MODE_TYPES = {"Float8Compute": "float8", "GradCompression": "grad_compression"}


def mode_type(name: str):
    import importlib

    from paratrain import modes

    if name in CAPABILITY_MODE_TYPES:
        return getattr(importlib.import_module(f"paratrain.capabilities.{CAPABILITY_MODE_TYPES[name]}"), name)
    return getattr(modes, name)


def mode_choices(name: str) -> tuple:
    """The strings a mode type's choices are: a Literal's values, or an enum's members' values."""
    import enum
    import typing

    kind = mode_type(name)
    return tuple(m.value for m in kind) if isinstance(kind, enum.EnumMeta) else typing.get_args(kind)
# Expressions named like a mode: a compared value shared with another setting's choices ("none") counts as a mode's
# when the other side is one of these.
MODE_NAMES = {"dp_mode", "pp_schedule", "schedule", "sched", "checkpointing", "activation_checkpoint", "ac",
              "precision", "dtype", "grad_compression", "compression", "method", "site"}


def mode_values() -> tuple[dict[str, str], set[str]]:
    """({value: the mode it is a choice of}, values that are also a choice of another setting, e.g. "none")."""
    import typing

    from paratrain import config, modes

    values = {}
    for name in MODE_TYPES:
        values.update({v: name for v in mode_choices(name) if v not in values})
    values.update({site.value: "CompressionSite" for site in modes.CompressionSite if site.value not in values})
    others = set()
    for section in dataclasses.fields(config.Config):
        for annotation in typing.get_type_hints(type(getattr(config.Config(), section.name))).values():
            args = config.annotation_members(annotation)  # (its Literal values and types)
            if not any(mode_choices(name) == args for name in MODE_TYPES):
                others.update(a for a in args if isinstance(a, str))
    return values, others & set(values)


def _strings(node: ast.AST) -> list[str]:
    """The string constants a compared operand is: one, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _names(node: ast.AST) -> set[str]:
    """The names an expression reads: variables, attributes and string subscripts (`row["method"]`)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            out.add(n.slice.value)
    return out


def mode_enums() -> set[str]:
    """The kinds of mode that are StrEnums in paratrain/modes.py (their members compared outside the owners decide a
    mode there too; CompressionSite, a plain Enum, is `Layout`'s answer, asked everywhere)."""
    import enum

    from paratrain import modes

    return {name for name, kind in vars(modes).items() if isinstance(kind, type) and issubclass(kind, enum.StrEnum)}


def _members(node: ast.AST, enums: set[str]) -> list[str]:
    """The members of a mode enum a compared operand names: `Schedule.ZBV`, or a tuple/list/set of them."""
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [f"{e.value.id}.{e.attr}" for e in elts
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in enums]


def find_mode_strings(tree: ast.Module, values: dict[str, str], shared: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each comparison with a mode's string (`x == "fp32"`, `mode in ("none", "every_k")`) or a mode
    enum's member (`s is Schedule.ZBV`) and each table of a mode's choices written out again (a tuple, list, set or
    dict keys of two or more)."""
    found = []
    enums = mode_enums()
    compared = {id(o) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                for o in (node.left, *node.comparators)}  # (a compared tuple is no table)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = set().union(*(_names(o) for o in operands if not _strings(o)))
            hits = [v for o in operands for v in _strings(o) if v in values
                    and (v not in shared or named & MODE_NAMES)]
            members = [m for o in operands for m in _members(o, enums)]
            if hits:
                found.append((node.lineno, f"compares {values[hits[0]]} '{hits[0]}'"))
            elif members:
                found.append((node.lineno, f"compares {members[0]}"))
        else:
            if isinstance(node, ast.Dict):
                items = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in compared:
                items = _strings(node)
            else:
                continue
            kinds = [values[v] for v in items if v in values and v not in shared]
            repeated = {k for k in kinds if kinds.count(k) >= 2}
            if repeated:
                found.append((node.lineno, f"lists {sorted(repeated)[0]} choices {items}"))
    return sorted(found)


def test_modes_are_compared_in_their_owners_only():
    """A mode's string (dp mode, pipeline schedule, checkpointing mode, precision, gradient compression method or
    site) is compared, and its choices are listed, only in paratrain/modes.py, paratrain/layout.py and the capability
    module whose section it is: like
    `grep -rn '== "fsdp"'`, through the syntax tree."""
    values, shared = mode_values()
    hits = []
    for folder in MODE_SCANNED:
        for path in python_files(folder):
            if path in MODE_OWNERS:
                continue
            hits += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in find_mode_strings(parse(path),
                                                                                                     values, shared)]
    assert not hits, ("mode strings outside their owners (paratrain/modes.py, layout.py, capabilities/; ask their "
                      "predicates or their enum members' properties, take "
                      "the choices from their types):\n" + "\n".join(hits))


def test_mode_finder_sees_comparisons_and_tables():
    values, shared = mode_values()
    assert "none" in shared and "fp32" not in shared  # "none" is also metrics.progress's and rope_scaling's
    source = ("a = cfg.parallel.dp_mode == 'hsdp'\n"
              "b = s in ('gpipe', '1f1b')\n"
              "c = self.mode != 'none'\n"  # progress: another setting's "none"
              "d = ac.mode == 'none' or checkpointing != 'none'\n"
              "e = {'fp32': 4, 'bf16': 2}\n"
              "f = ('none', 'bf16')\n"  # one compression method and a precision: no table
              "g = row['method'] == 'none'\n"
              "h = lay.pp_schedule is Schedule.ZBV or mode in (DPMode.DDP, DPMode.ZERO1)\n"
              "i = [Schedule.GPIPE] + [CheckpointMode.NONE]\n")  # (members named, not compared)
    found = find_mode_strings(ast.parse(source), values, shared)
    assert sorted({line for line, _ in found}) == [1, 2, 4, 5, 7, 8], found


def test_layout_does_not_import_torch():
    code = "import sys, paratrain.layout; assert 'torch' not in sys.modules, 'paratrain.layout imported torch'"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.stdout


# -- the error path ------------------------------------------------------------------------------------------------

# errors.translated is where an exception of any class becomes a one-line error; files.py's restores put the old
# folder back and re-raise (they translate nothing).
BASE_EXCEPTION_ALLOWED_IN = {PACKAGE / "errors.py"}
RESTORE_AND_RAISE_ALLOWED_IN = {PACKAGE / "files.py"}


def base_exception_catches(tree: ast.Module, where, restore_and_raise: bool = False) -> list[str]:
    """Handlers that catch BaseException (`except:`, `except BaseException`, in a tuple too); with
    restore_and_raise, those whose last statement is a bare `raise` are allowed."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ExceptHandler):
            continue
        caught = [] if node.type is None else node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
        if node.type is not None and not any(isinstance(c, ast.Name) and c.id == "BaseException" for c in caught):
            continue
        last = node.body[-1]
        if restore_and_raise and isinstance(last, ast.Raise) and last.exc is None:
            continue
        found.append(f"{where}:{node.lineno}: except {ast.unparse(node.type) if node.type else ''}".rstrip())
    return found


def test_only_the_error_path_catches_base_exception():
    found = [line for path in python_files(PACKAGE) if path not in BASE_EXCEPTION_ALLOWED_IN
             for line in base_exception_catches(parse(path), path.relative_to(ROOT),
                                                restore_and_raise=path in RESTORE_AND_RAISE_ALLOWED_IN)]
    assert not found, ("BaseException caught outside paratrain/errors.py (use `with errors.translated(...)`):\n"
                       + "\n".join(found))


def test_base_exception_finder():
    source = ("try:\n    f()\nexcept BaseException:\n    g()\n"
              "try:\n    f()\nexcept (OSError, BaseException) as e:\n    raise\n"
              "try:\n    f()\nexcept:\n    pass\n"
              "try:\n    f()\nexcept Exception:\n    pass\n")
    tree = ast.parse(source)
    assert base_exception_catches(tree, "x.py") == ["x.py:3: except BaseException",
                                                    "x.py:7: except (OSError, BaseException)", "x.py:11: except"]
    assert base_exception_catches(tree, "x.py", restore_and_raise=True) == ["x.py:3: except BaseException",
                                                                            "x.py:11: except"]


# -- function length -----------------------------------------------------------------------------------------------
# A function (a method, a nested function) fits on a screen: longer ones are split by meaning (a phase, a concern),
# each part named for what it does.
MAX_FUNCTION_LINES = 80


def long_functions(tree: ast.Module, where) -> list[str]:
    """`where:line: name (N lines)` for each function longer than MAX_FUNCTION_LINES, from its def line to its last
    line, nested ones by their qualified name."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
                lines = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{child.lineno}: {prefix}{child.name} ({lines} lines)")
            visit(child, name)

    visit(tree, "")
    return found


def test_no_function_is_longer_than_80_lines():
    found = [line for path in python_files(PACKAGE) for line in long_functions(parse(path), path.relative_to(ROOT))]
    assert not found, (f"functions longer than {MAX_FUNCTION_LINES} lines (def to last line): split each by meaning "
                       "(a phase, a concern), the parts named for what they do:\n" + "\n".join(found))


def test_long_function_finder():
    def function(name: str, lines: int, indent: str = "") -> str:
        return f"{indent}def {name}():\n" + "".join(f"{indent}    x = {k}\n" for k in range(lines - 1))

    source = function("short", 80) + function("long", 81) + "class C:\n" + function("method", 81, "    ")
    assert long_functions(ast.parse(source), "x.py") == ["x.py:81: long (81 lines)", "x.py:163: C.method (81 lines)"]
