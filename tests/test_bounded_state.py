"""Process-wide state stays bounded: every module-level store of the package is a bounded cache
(``contract.lru.LRU`` / ``LRUSet``, ``CompileCache``, ``functools.lru_cache`` with a finite
``maxsize``), a weak table, or on the allow-list below with the reason it cannot grow (a
constant table, a function of no arguments). A long job whose masks, lengths or captured values
change meets new keys every step; an unbounded store would keep every one."""

from __future__ import annotations

import ast
import pathlib
import threading

import pytest

from compilemask.compiler import bounds
from compilemask.contract.cache import CompileCache
from compilemask.contract.lru import LRU, LRUSet

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("compilemask", "dsl", "codegen", "kernels")

# path:name -> why it cannot grow with a job's masks, lengths or values (one line each)
ALLOWED = {
    "compilemask/contract/lru.py:_SOURCES": "bounded by register_source: MAX_SOURCES entries",
    "compilemask/contract/cache.py:_REGISTERED": "bounded by exec_verified: MAX_REGISTERED entries",
    "dsl/tracing.py:RELATIONS": "constant table: comparison operator -> relation",
    # the op contract and the flash-attn-4 adapter
    "kernels/contract.py:LIST_SLOTS": "constant table: the list slots' names",
    "kernels/contract.py:_SCHEMA_TYPES": "constant table: annotation -> schema type",
    "kernels/fa4_lib.py:_SAVED": "FA4's globals while our patches are in: as many as PATCHES",
    "kernels/fa4_lib.py:_unavailable_reason": "no arguments: one entry",
    # functions of no arguments (or of a few fixed folder names): one entry each
    "compilemask/contract/env.py:cache_dir": "keyed by the few fixed folder kinds of the package",
    "compilemask/integrations/torchtitan/_compat.py:_legacy_attention_cls": "no arguments",
    "compilemask/contract/env.py:cute_dsl_arch": "no arguments: one entry",
    "compilemask/contract/env.py:configure_compile_caches": "no arguments: one entry",
    "compilemask/pipeline/pipeline.py:has_tilelang": "no arguments: one entry",
    "compilemask/contract/env.py:_FALLBACK": "one entry: this process's private fallback folder",
    "compilemask/integrations/torchtitan/__init__.py:_WHERE": "constant table of lazy names",
    "compilemask/integrations/torchtitan/_compat.py:_plan_balancer_cls": "no arguments: one entry",
    "compilemask/integrations/torchtitan/_compat.py:legacy": "no arguments: one entry",
    # constant tables, written once at import (or, _TORCH_NS, by one exec of a fixed prelude)
    "compilemask/contract/descriptor.py:LIST_KINDS": "constant table",
    "dsl/flex.py:_TORCH_FUNCS": "constant table",
    "dsl/flex.py:_PAIR_TESTS": "constant table",
    "dsl/flex.py:_TORCH_NS": "the namespace of one exec of the fixed torch prelude",
    "compilemask/pipeline/heads.py:_HEAD_AXIS": "constant table",
    "compilemask/masks/__init__.py:EXAMPLES": "constant table",
    "compilemask/masks/shared_prompt_rm.py:ENDS": "constant table",
    "compilemask/contract/options.py:_CHOICES": "constant table",
    "compilemask/pipeline/render.py:_CHARS": "constant table",
    "dsl/score_mod.py:_TORCH_FUNCS": "constant table",
    "dsl/score_mod.py:_METHODS": "constant table",
    "compilemask/api/viz.py:PALETTE": "constant table",
    "compilemask/api/viz.py:_REGION_COLOURS": "constant table",
    "dsl/frontend.py:_INT_BIT_OPS": "constant table",
    "dsl/frontend.py:_BOOL_OPS_SYM": "constant table",
    "codegen/blocksparse.py:_SHARED": "constant table",
    "codegen/cute_mask_mod.py:_UNWRAPPED": "constant source lines",
    "codegen/cute_predicate.py:_REL_OPS": "constant table",
    "codegen/cute_score_mod.py:_NAMES": "constant table",
    "codegen/cute_score_mod.py:_I2F": "constant source lines",
    "codegen/tilelang_build.py:CUDA_TARGET": "constant table",
    "kernels/__init__.py:_LAZY": "constant table",
    "kernels/bwd_aux.py:_DTYPES": "constant table",
    "kernels/config.py:DTYPES": "constant table",
    "kernels/fa4.py:BWD_TILE_M": "constant table",
}

_CONTAINERS = ("dict", "set", "list", "defaultdict", "OrderedDict", "Counter", "deque")
_BOUNDED = ("LRU", "LRUSet", "CompileCache")
_WEAK = ("WeakKeyDictionary", "WeakValueDictionary", "WeakSet")


def _call_name(node) -> str:
    return ast.unparse(node.func).split(".")[-1] if isinstance(node, ast.Call) else ""


def _cache_decorator(d) -> str | None:
    """'bounded', 'unbounded' or None (not a cache) for a decorator."""
    name = ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1]
    if name == "cache":
        return "unbounded"
    if name != "lru_cache":
        return None
    if not isinstance(d, ast.Call):
        return "bounded"  # @lru_cache: maxsize 128
    size = d.args[0] if d.args else next((k.value for k in d.keywords if k.arg == "maxsize"),
                                         None)
    if size is None:
        return "bounded" if not d.args and not d.keywords else "unbounded"
    return "bounded" if isinstance(size, ast.Constant) and isinstance(size.value, int) \
        else "unbounded"


def module_stores() -> dict:
    """path:name -> 'bounded' | 'weak' | 'unbounded' for every module-level store (assigned
    containers and caching decorators, on functions and on class methods)."""
    out = {}
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text())
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = [t.id for t in targets if isinstance(t, ast.Name)]
                    v = node.value
                    call = _call_name(v)
                    if call in _BOUNDED:
                        kind = "bounded"
                    elif call in _WEAK:
                        kind = "weak"
                    elif isinstance(v, (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp,
                                        ast.ListComp)) or call in _CONTAINERS:
                        kind = "unbounded"
                    else:
                        continue
                    for n in names:
                        if n != "__all__":
                            out[f"{rel}:{n}"] = kind
                funcs = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    else [f for f in node.body if isinstance(f, ast.FunctionDef)] \
                    if isinstance(node, ast.ClassDef) else []
                for f in funcs:
                    for d in f.decorator_list:
                        kind = _cache_decorator(d)
                        if kind:
                            out[f"{rel}:{f.name}"] = kind
    return out


def test_every_module_level_store_is_bounded_weak_or_allowed():
    stores = module_stores()
    assert len(stores) > 40, "the scan found too few stores: is it reading the package?"
    unbounded = sorted(k for k, kind in stores.items() if kind == "unbounded"
                       and k not in ALLOWED)
    assert not unbounded, (
        f"module-level stores that may grow without limit: {unbounded}; make each a "
        "compilemask.contract.lru.LRU(n) / LRUSet(n) (or functools.lru_cache(maxsize=n)) with its "
        "size in a comment, or add it to ALLOWED with why it cannot grow")
    stale = sorted(k for k in ALLOWED if stores.get(k) != "unbounded")
    assert not stale, f"ALLOWED names stores that are gone or bounded now: {stale}"


def test_scan_classifies_stores():
    src = ("import functools, weakref\nA = {}\nB: dict = dict()\nC = LRU(4)\n"
           "D = weakref.WeakKeyDictionary()\n@functools.cache\ndef f(x): pass\n"
           "@functools.lru_cache(maxsize=None)\ndef g(x): pass\n"
           "@functools.lru_cache(maxsize=8)\ndef h(x): pass\nE = 3\n")
    tree = ast.parse(src)
    kinds = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            t = node.targets[0] if isinstance(node, ast.Assign) else node.target
            kinds[t.id] = _call_name(node.value) or type(node.value).__name__
        elif isinstance(node, ast.FunctionDef):
            kinds[node.name] = _cache_decorator(node.decorator_list[0])
    assert kinds == {"A": "Dict", "B": "dict", "C": "LRU", "D": "WeakKeyDictionary",
                     "f": "unbounded", "g": "unbounded", "h": "bounded", "E": "Constant"}


def test_lru_drops_least_recently_used():
    c = LRU(3)
    for k in "abc":
        c[k] = k.upper()
    assert c.get("a") == "A"  # a is now the most recent
    c["d"] = "D"
    assert "b" not in c and len(c) == 3 and c.keys() == ["c", "a", "d"]
    assert c.setdefault("e", "E") == "E" and "c" not in c
    assert c.setdefault("a", "X") == "A"
    with pytest.raises(KeyError):
        c["b"]
    assert c.get("b", 0) == 0 and c.pop("a") == "A" and c.pop("zz", None) is None
    c.clear()
    assert len(c) == 0
    with pytest.raises(ValueError, match="maxsize"):
        LRU(0)


def test_lru_set_is_bounded():
    s = LRUSet(2)
    for m in ("x", "y", "z"):
        s.add(m)
    assert "x" not in s and "y" in s and "z" in s and len(s) == 2
    s.discard("y")
    s.discard("y")
    assert list(s) == ["z"]


def test_lru_under_threads_stays_bounded_and_consistent():
    c = LRU(64)
    errors = []

    def work(t):
        try:
            for n in range(3000):
                k = (t, n % 200)
                c[k] = n
                got = c.get(k)
                assert got is None or got % 200 == n % 200
                c.setdefault((t, -1), t)
                assert len(c) <= 64
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(c) == 64


def test_compile_cache_is_bounded():
    cache = CompileCache("test", maxsize=4)
    for n in range(10):
        assert cache.get(n, lambda n=n: n * n) == n * n
    assert len(cache) == 4 and 9 in cache and 0 not in cache and cache.builds == 10
    assert cache.get(9, lambda: -1) == 81 and cache.builds == 10  # a hit builds nothing


def test_int32_fit_tables_stay_bounded_over_new_lengths():
    # a loop of new lengths and metadata bounds: one entry per (length, bound) before
    for n in range(bounds._WIDE.maxsize + 100):
        bounds.fits_int32(("bounded-state-test", 0), lambda: [], 1000 + n, 1 << 20)
    assert len(bounds._WIDE) == bounds._WIDE.maxsize
    assert len(bounds._LONGEST) <= bounds._LONGEST.maxsize


def test_generated_sources_in_linecache_are_bounded():
    import linecache

    from compilemask.contract import lru

    names = [f"<compilemask-test-source-{n}>" for n in range(lru.MAX_SOURCES + 100)]
    for n in names:
        lru.register_source(n, "x = 1\n")
    kept = [n for n in names if n in linecache.cache]
    assert kept == names[-lru.MAX_SOURCES:]


def test_verified_programs_leave_linecache_and_sys_modules(monkeypatch):
    """A program run from its checked text keeps that text in linecache while the module lives
    and no longer; programs registered in sys.modules stay within MAX_REGISTERED."""
    import gc
    import linecache
    import sys

    from compilemask.contract import cache

    monkeypatch.setattr(cache, "MAX_REGISTERED", 8)
    paths = [f"/nonexistent/compilemask-test-program-{n}.py" for n in range(20)]
    mods = [cache.exec_verified(f"X = {n}\n", p, f"_compilemask_test_prog_{n}", register=True)
            for n, p in enumerate(paths)]
    assert [m.X for m in mods] == list(range(20))
    assert all(p in linecache.cache for p in paths)  # alive: readable for a later trace
    registered = [n for n in range(20) if f"_compilemask_test_prog_{n}" in sys.modules]
    assert registered == list(range(12, 20))
    del mods
    gc.collect()  # the evicted ones lived only here; sys.modules holds the rest
    assert [n for n, p in enumerate(paths) if p in linecache.cache] == registered
    for n in registered:
        sys.modules.pop(f"_compilemask_test_prog_{n}", None)
    gc.collect()
    assert not any(p in linecache.cache for p in paths)
