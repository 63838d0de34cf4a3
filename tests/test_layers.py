"""The package's folders are its layers and its imports go one way: each layer is a folder (a
subpackage of ``compilemask``), a module's layer is its folder's, no cycles, no import of a
higher layer, and few function-local imports, each with a comment saying why. The sources are
parsed with ``ast``, never imported.

    python tests/test_layers.py   # print the violations and the function-local imports
"""

from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize
from dataclasses import dataclass

import pytest

# Folder (package) -> layer. A module may import from its own layer or a lower one. A module's
# layer is its folder's: a new module goes into the folder of its layer (the package's root
# folder holds only its face, __init__ and __main__).
LAYERS = {
    "compilemask.contract": 0,      # compilemask/contract/: descriptor, options, env, cache, log
    "compilemask.dsl": 1,           # dsl/: MaskSpec and the front ends
    "compilemask.compiler": 2,      # compilemask/compiler/: rules -> intervals, proofs, reference
    "compilemask.codegen": 3,       # codegen/: TileLang and CuTe programs
    "compilemask.pipeline": 4,      # compilemask/pipeline/: compile_mask, preprocess
    "compilemask.kernels": 5,       # kernels/: the engines
    "compilemask.api": 6,           # compilemask/api/: attention, serving, cli
    "compilemask.masks": 6,         # compilemask/masks/: the catalogue of masks
    "compilemask.integrations": 6,  # compilemask/integrations/: transformers
    "compilemask": 6,               # compilemask/: __init__, __main__ only
}

# imports inside function bodies hide the graph from the reader; the few that are needed (lazy
# optional dependencies, startup time) say why in a comment
MAX_FUNCTION_LOCAL = 12

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "compilemask"
# pyproject.toml's [tool.setuptools.package-dir]: folder -> the package it holds
PACKAGE_DIRS = {
    "compilemask": "compilemask",
    "dsl": "compilemask.dsl",
    "codegen": "compilemask.codegen",
    "kernels": "compilemask.kernels",
}


@dataclass(frozen=True)
class Import:
    """One import statement of a project module that names project modules."""

    module: str  # the importing module
    path: str  # its file, relative to the repository root
    line: int
    targets: tuple[str, ...]  # the project modules it names
    packages: tuple[str, ...]  # the packages above them that run first (not the importer's)
    local: bool  # inside a function body
    explained: bool  # a comment on its lines or on the line above
    code: str  # the statement's first line, stripped


def find_modules(root: pathlib.Path = ROOT, package_dirs=None) -> dict[str, str]:
    """Module name -> its file relative to ``root``, for every ``.py`` file under the package
    folders."""
    found = {}
    for folder, package in (package_dirs or PACKAGE_DIRS).items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path.relative_to(root).as_posix()
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(nodes, local: bool = False, typing_only: bool = False):
    """Every import statement with (in a function body, under ``if TYPE_CHECKING:``)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, local, typing_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, local, True)
            yield from _walk(node.orelse, local, typing_only)  # the else branch runs
        else:
            inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                               ast.Lambda))
            yield from _walk(ast.iter_child_nodes(node), inner, typing_only)


def _in_project(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:n]) for n in range(1, len(parts) + 1)}


def _targets(node, module: str, is_package: bool, known) -> list[str]:
    """The project modules an import statement imports: ``from p import x`` imports ``p``, and
    ``p.x`` too where that is a module; relative imports are resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if _in_project(a.name)]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    if not _in_project(base):
        return []
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    # ``from . import sibling`` in a package's own module: the package's __init__ ran before
    # this module did, and only the submodules are loaded; a name defined by that __init__
    # (not a submodule) does depend on it
    if base in _ancestors(module) and len(subs) == len(node.names):
        return subs
    return [base] + subs


def _packages(targets, module: str, known) -> list[str]:
    """The packages Python initializes before ``targets``: ``import a.b.c`` runs ``a.b``'s
    ``__init__`` first. The importer's own packages are left out: they ran before it did."""
    own = _ancestors(module)
    out = []
    for target in targets:
        parts = target.split(".")
        for n in range(1, len(parts)):
            package = ".".join(parts[:n])
            if package in known and package not in own and package not in targets:
                out.append(package)
    return list(dict.fromkeys(out))


def _comment_lines(source: str) -> set[int]:
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
    return lines


def scan(root: pathlib.Path = ROOT, package_dirs=None) -> tuple[dict, list[Import]]:
    """``(modules, imports)``: every project module's file and every import statement of a
    project module that names project modules, except those under ``if TYPE_CHECKING:``, which
    never run and so close no cycle and need no layer."""
    modules = find_modules(root, package_dirs)
    imports = []
    for module, path in modules.items():
        source = (root / path).read_text()
        tree = ast.parse(source, filename=path)
        comments = _comment_lines(source)
        # imports under ``if TYPE_CHECKING:`` never run: left out of the graph and the counts
        found = [(n, loc) for n, loc, typing_only in _walk(tree.body) if not typing_only]
        # a comment on another import's line is that import's
        import_lines = {ln for n, _ in found for ln in range(n.lineno, n.end_lineno + 1)}
        lines = source.splitlines()
        for node, local in found:
            targets = _targets(node, module, path.endswith("__init__.py"), modules)
            if not targets:
                continue
            own = any(ln in comments for ln in range(node.lineno, node.end_lineno + 1))
            above = node.lineno - 1 in comments and node.lineno - 1 not in import_lines
            targets = tuple(dict.fromkeys(targets))
            imports.append(Import(module, path, node.lineno, targets,
                                  tuple(_packages(targets, module, modules)), local,
                                  own or above, lines[node.lineno - 1].strip()))
    return modules, imports


def layer_of(module: str, layers=None) -> int | None:
    """The module's layer: the entry of the module or of the nearest package above it."""
    layers = LAYERS if layers is None else layers
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in layers:
            return layers[key]
    return None


# the modules the package's root folder may hold: its face
ROOT_MODULES = {PACKAGE, f"{PACKAGE}.__main__"}


def folder_violations(modules, layers=None) -> list[str]:
    """Each layer is a folder: every entry of ``layers`` but the root is a package right under
    it, and every module lives in one of them (the root holds only ``ROOT_MODULES``)."""
    layers = LAYERS if layers is None else layers
    out = []
    for key in layers:
        if key == PACKAGE:
            continue
        path = modules.get(key, "")
        if key.rpartition(".")[0] != PACKAGE or not path.endswith("__init__.py"):
            out.append(f"LAYERS entry {key}: not a folder (package) right under {PACKAGE}")
    for m, path in sorted(modules.items()):
        if m.rpartition(".")[0] != PACKAGE or m in layers or m in ROOT_MODULES:
            continue
        if path.endswith("__init__.py"):
            out.append(f"{path}: folder {m} has no layer in LAYERS")
        else:
            out.append(f"{path}: module {m} lies in the package's root folder; move it into the "
                       f"folder of its layer (LAYERS)")
    return out


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative) with more than one module."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _edges(imp: Import):
    yield from ((t, "") for t in imp.targets)
    yield from ((p, " (its __init__ runs first)") for p in imp.packages)


def import_graph(modules, imports) -> dict[str, set[str]]:
    """Module -> the project modules it imports, the packages that run first included."""
    graph = {m: set() for m in modules}
    for imp in imports:
        graph[imp.module].update(t for t, _ in _edges(imp) if t in modules and t != imp.module)
    return graph


def cycle_violations(modules, imports) -> list[str]:
    """One message per import cycle: its files, then the imports inside it (break one)."""
    out = []
    for comp in _sccs(import_graph(modules, imports)):
        members = set(comp)
        files = [modules[m] for m in comp]
        edges = [f"    {imp.path}:{imp.line} imports {t}{note}" for imp in imports
                 if imp.module in members
                 for t, note in _edges(imp) if t in members and t != imp.module]
        out.append(f"import cycle through {len(comp)} files: {', '.join(files)}\n"
                   + "\n".join(edges))
    return out


def layer_violations(modules, imports, layers=None) -> list[str]:
    """Modules with no layer, and every import of a higher layer than the importer's."""
    out = [f"{path}: module {m} has no layer in LAYERS" for m, path in sorted(modules.items())
           if layer_of(m, layers) is None]
    for imp in imports:
        a = layer_of(imp.module, layers)
        named = [layer_of(t, layers) for t in imp.targets]
        for t, b in zip(imp.targets, named):
            if b is None and t not in modules:
                out.append(f"{imp.path}:{imp.line} imports {t}, which is no module of the "
                           f"project and has no layer")
            elif a is not None and b is not None and b > a:
                out.append(f"{imp.path}:{imp.line} imports {t} (layer {a} -> {b})")
        # a package above a named module: only news when it sits higher than all of them
        top = max((b for b in named if b is not None), default=-1)
        for p in imp.packages:
            b = layer_of(p, layers)
            if a is not None and b is not None and b > max(a, top):
                out.append(f"{imp.path}:{imp.line} imports {p}, whose __init__ runs first "
                           f"(layer {a} -> {b})")
    return out


def local_violations(imports, limit: int = MAX_FUNCTION_LOCAL) -> list[str]:
    """Function-local project imports past ``limit``, and those without a comment."""
    local = [imp for imp in imports if imp.local]
    out = [f"{len(local)} function-local project imports, more than {limit}"] * (
        len(local) > limit)
    return out + [f"{imp.path}:{imp.line} has no comment saying why: {imp.code}"
                  for imp in local if not imp.explained]


def local_listing(imports) -> str:
    """Every function-local project import, one a line; those without a comment marked."""
    return "\n".join(f"  {imp.path}:{imp.line} {imp.code}"
                     + ("" if imp.explained else "   <- no comment")
                     for imp in imports if imp.local)


# ----------------------------------------------------------------------------------------------
# the checks
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def project():
    return scan()


def _fail(title: str, violations: list[str], more: str = ""):
    if violations:
        pytest.fail(f"{title}:\n" + "\n".join(violations) + more, pytrace=False)


def test_each_layer_is_a_folder(project):
    _fail("layers that are no folder, and modules outside the layers' folders",
          folder_violations(project[0]))


def test_no_import_cycles(project):
    _fail("import cycles among the package's modules", cycle_violations(*project))


def test_imports_go_down_the_layers(project):
    _fail("imports of a higher layer (layer of the importer -> layer of the imported)",
          layer_violations(*project))


def test_function_local_imports_are_few_and_explained(project):
    imports = project[1]
    _fail("function-local imports", local_violations(imports),
          "\n\nall function-local project imports:\n" + local_listing(imports))


def test_scan_resolves_imports(tmp_path):
    """The scanner on a small tree: package folders, relative imports, function-local and
    TYPE_CHECKING imports, third-party imports ignored."""
    files = {
        "core/__init__.py": "from .a import f\n",
        "core/a.py": ("from typing import TYPE_CHECKING\nimport numpy\n"
                      "if TYPE_CHECKING:\n    from compilemask.ext import g\n"
                      "def f():\n    # lazy: ext imports this module\n"
                      "    from compilemask.ext import g\n    return g\n"
                      "def h():\n    import compilemask.ext.g\n"),
        "ext/__init__.py": "",
        "ext/g.py": "from .. import a\nfrom ..ext import g\nfrom compilemask import f\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    dirs = {"core": "compilemask", "ext": "compilemask.ext"}
    modules, imports = scan(tmp_path, dirs)
    assert sorted(modules) == ["compilemask", "compilemask.a", "compilemask.ext",
                               "compilemask.ext.g"]
    got = {(i.module, i.line): (i.targets, i.packages, i.local, i.explained) for i in imports}
    ext, g = "compilemask.ext", "compilemask.ext.g"
    assert got == {
        ("compilemask", 1): (("compilemask.a",), (), False, False),
        ("compilemask.a", 7): ((ext, g), (), True, True),
        ("compilemask.a", 10): ((g,), (ext,), True, False),  # ext's __init__ runs first
        # submodules of the importer's own packages: those packages ran before it
        ("compilemask.ext.g", 1): (("compilemask.a",), (), False, False),
        ("compilemask.ext.g", 2): ((g,), (), False, False),
        # a name the package's __init__ defines: that __init__ is imported
        ("compilemask.ext.g", 3): (("compilemask",), (), False, False),
    }
    layers = {"compilemask": 1, "compilemask.a": 0, ext: 3, g: 2}
    assert layer_violations(modules, imports, layers) == [
        "core/a.py:7 imports compilemask.ext (layer 0 -> 3)",
        "core/a.py:7 imports compilemask.ext.g (layer 0 -> 2)",
        "core/a.py:10 imports compilemask.ext.g (layer 0 -> 2)",
        "core/a.py:10 imports compilemask.ext, whose __init__ runs first (layer 0 -> 3)"]
    assert _sccs(import_graph(modules, imports)) == [["compilemask", "compilemask.a", g]]
    assert cycle_violations(modules, imports) == [
        "import cycle through 3 files: core/__init__.py, core/a.py, ext/g.py\n"
        "    core/__init__.py:1 imports compilemask.a\n"
        "    core/a.py:7 imports compilemask.ext.g\n"
        "    core/a.py:10 imports compilemask.ext.g\n"
        "    ext/g.py:1 imports compilemask.a\n"
        "    ext/g.py:3 imports compilemask"]
    assert folder_violations(modules, {"compilemask": 1, ext: 2}) == [
        "core/a.py: module compilemask.a lies in the package's root folder; move it into the "
        "folder of its layer (LAYERS)"]
    assert folder_violations(modules, {"compilemask": 1, "compilemask.a": 0, g: 2}) == [
        "LAYERS entry compilemask.a: not a folder (package) right under compilemask",
        "LAYERS entry compilemask.ext.g: not a folder (package) right under compilemask",
        "ext/__init__.py: folder compilemask.ext has no layer in LAYERS"]
    assert local_violations(imports, limit=1) == [
        "2 function-local project imports, more than 1",
        "core/a.py:10 has no comment saying why: import compilemask.ext.g"]


def test_package_dirs_match_pyproject():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = pyproject["tool"]["setuptools"]["package-dir"]
    assert {folder: package for package, folder in dirs.items()} == PACKAGE_DIRS


def main() -> int:
    modules, imports = scan()
    checks = [("folders", folder_violations(modules)),
              ("cycles", cycle_violations(modules, imports)),
              ("upward imports", layer_violations(modules, imports)),
              ("function-local imports", local_violations(imports))]
    for title, violations in checks:
        print(f"{title}: {len(violations) or 'no'} violation{'' if len(violations) == 1 else 's'}")
        for v in violations:
            print(f"  {v}")
    print(f"\nfunction-local project imports (limit {MAX_FUNCTION_LOCAL}):")
    print(local_listing(imports))
    return 1 if any(v for _, v in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
