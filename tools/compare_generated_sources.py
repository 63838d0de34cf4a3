"""Compare every generated source of two checkouts byte for byte.

    python tools/compare_generated_sources.py OLD_CHECKOUT [NEW_CHECKOUT] [--diff-dir DIR]

(``git worktree add /tmp/old <commit>`` makes OLD_CHECKOUT; NEW_CHECKOUT defaults to this
checkout). Each checkout runs, in its own process with the ``compilemask`` package mapped to
its folders (as pyproject's package-dir does, no install needed), the collector
``tests/regen_generated_sources.py`` of THIS checkout, which finds each generator at its
layered or its flat module path. Sources are then sorted into: equal; different only in module
paths the checkouts moved (``compilemask.descriptor`` -> ``compilemask.contract.descriptor``,
read from git's renames between the two commits); different otherwise (a unified diff each,
written to DIR when given). Exit status 1 when any source differs other than by a moved path.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
COLLECTOR = HERE / "tests" / "regen_generated_sources.py"
# pyproject's [tool.setuptools.package-dir]: folder -> package
PACKAGE_DIRS = {"compilemask": "compilemask", "dsl": "compilemask.dsl",
                "codegen": "compilemask.codegen", "kernels": "compilemask.kernels"}

_CHILD = r"""
import importlib.abc, importlib.machinery, importlib.util, json, os, sys
root, collector, out = sys.argv[1:4]
dirs = json.loads(sys.argv[4])
pkgs = {pkg: os.path.join(root, d) for d, pkg in dirs.items()}


class _Checkout(importlib.abc.MetaPathFinder):
    # the four top-level packages from this checkout's folders; their modules then come from
    # the packages' __path__ only (never the installed editable finder's folders)
    def find_spec(self, name, path=None, target=None):
        if name in pkgs:
            return importlib.util.spec_from_file_location(
                name, os.path.join(pkgs[name], "__init__.py"),
                submodule_search_locations=[pkgs[name]])
        if name.startswith("compilemask."):  # only here: a module this checkout lacks is missing
            found = importlib.machinery.PathFinder.find_spec(name, path)
            if found is None:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return found
        return None


sys.meta_path.insert(0, _Checkout())
spec = importlib.util.spec_from_file_location("regen_generated_sources", collector)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sources = mod.collect()
files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())
         if n == "compilemask" or n.startswith("compilemask.")}
outside = {n: f for n, f in files.items()
           if f and not os.path.realpath(f).startswith(os.path.realpath(root) + os.sep)}
if outside:
    sys.exit(f"modules loaded from outside {root}: {outside}")
import compilemask
json.dump({"sources": sources, "resolved": mod.RESOLVED, "file": compilemask.__file__,
           "modules": len(files)}, open(out, "w"))
"""


def collect(root: Path, workdir: Path) -> dict:
    out = workdir / (root.name + ".json")
    env = dict(os.environ, COMPILEMASK_CACHE_DIR=str(workdir / "cache"),
               TILELANG_CACHE_DIR=str(workdir / "cache" / "tilelang"), PYTHONHASHSEED="0")
    subprocess.run([sys.executable, "-c", _CHILD, str(root), str(COLLECTOR), str(out),
                    json.dumps(PACKAGE_DIRS)], check=True, cwd=workdir, env=env)
    return json.loads(out.read_text())


def _module(path: str) -> str | None:
    top, _, rest = path.partition("/")
    if top not in PACKAGE_DIRS or not path.endswith(".py"):
        return None
    mod = PACKAGE_DIRS[top] + ("." + rest[:-3].replace("/", ".") if rest else "")
    return mod.removesuffix(".__init__")


def moved_modules(old: Path, new: Path) -> dict[str, str]:
    """Old module path -> new, from git's renames between the checkouts' commits."""
    base = subprocess.run(["git", "-C", str(old), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    names = subprocess.run(["git", "-C", str(new), "diff", "-M", "--name-status",
                            "--diff-filter=R", base, "HEAD"], check=True, capture_output=True,
                           text=True).stdout
    moved = {}
    for line in names.splitlines():
        _, a, b = line.split("\t")
        ma, mb = _module(a), _module(b)
        if ma and mb and ma != mb:
            moved[ma] = mb
            moved[a] = b  # the file's path too
    return moved


def normalize(text: str, moved: dict[str, str]) -> str:
    """``text`` with each moved module (and file) path written at its new place."""
    if not moved:
        return text
    pat = re.compile(r"(?<![\w./])(" + "|".join(
        re.escape(k) for k in sorted(moved, key=len, reverse=True)) + r")(?![\w/])")
    return pat.sub(lambda m: moved[m.group(1)], text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path, nargs="?", default=HERE)
    ap.add_argument("--diff-dir", type=Path)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gensrc-") as tmp:
        got = {}
        for side, root in (("old", a.old), ("new", a.new)):
            (Path(tmp) / side).mkdir()
            got[side] = collect(root.resolve(), Path(tmp) / side)
            print(f"{side}: {root} -> compilemask at {got[side]['file']}, "
                  f"{len(got[side]['sources'])} sources, {got[side]['modules']} modules; "
                  f"generators from {got[side]['resolved']}")
    moved = moved_modules(a.old, a.new)
    old, new = got["old"]["sources"], got["new"]["sources"]
    rows, diffs = [], {}
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            rows.append((key, "only in " + ("new" if key in new else "old")))
        elif old[key] == new[key]:
            rows.append((key, "equal"))
        elif normalize(old[key], moved) == new[key]:
            rows.append((key, "moved paths only"))
            diffs[key] = old[key], new[key]
        else:
            rows.append((key, "DIFFERS"))
            diffs[key] = old[key], new[key]
    for key, verdict in rows:
        if verdict != "equal":
            print(f"{verdict:18s} {key}")
    counts = {v: sum(r[1] == v for r in rows) for v in sorted({r[1] for r in rows})}
    print("summary:", counts)
    if a.diff_dir:
        a.diff_dir.mkdir(parents=True, exist_ok=True)
        for key, (o, n) in diffs.items():
            (a.diff_dir / (key.replace("/", "__") + ".diff")).write_text("".join(
                difflib.unified_diff(o.splitlines(True), n.splitlines(True),
                                     f"old/{key}", f"new/{key}")))
    return int(any(v == "DIFFERS" or v.startswith("only") for _, v in rows))


if __name__ == "__main__":
    sys.exit(main())
