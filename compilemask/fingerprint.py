"""What a Python function can read, as a hashable key: its code, closure cells, the globals its
code names and its defaults, recursively through the functions, tuples, lists and dicts it holds.

Ints and other atoms are keyed by value, tensors by rank and dtype (their values are runtime
data), modules by name, other hashable objects by identity (the key keeps them alive, so an id is
never reused while a key holds it). ``compile_mask`` caches compiled specs by these keys, and
``from_mask_mod`` caches conversions by them; ``Walk(trace)`` also builds a copy of each function
in which captured tensors are the trace's stand-ins.
"""

from __future__ import annotations

import types

import torch

__all__ = ["Walk", "Uncacheable", "function_key"]


class Uncacheable(Exception):
    """A captured value that cannot be part of a cache key (unhashable, not a container)."""


_ATOMS = (int, bool, float, str, complex, type(None), torch.dtype, torch.device)
_GLOBAL_NAMES: dict = {}


def _global_names(code) -> tuple[str, ...]:
    """The global (and attribute) names a code object and its nested code objects load."""
    names = _GLOBAL_NAMES.get(code)
    if names is None:
        seen, todo = [], [code]
        while todo:
            c = todo.pop()
            seen += c.co_names
            todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        names = _GLOBAL_NAMES[code] = tuple(dict.fromkeys(seen))
    return names


class Walk:
    """One walk: the key of everything a mask_mod can read, the tensors in walk order and, when
    tracing, a copy of each function whose tensors are stand-ins."""

    def __init__(self, trace=None):
        self.trace = trace
        self.leaves: list[torch.Tensor] = []
        self.by_id: dict[int, int] = {}
        self.funcs: dict = {}  # function -> (key, copy); None while being walked

    def value(self, v, name):
        t = type(v)
        if t in _ATOMS:
            return (t, v), v
        if isinstance(v, torch.Tensor):
            k = self.by_id.get(id(v))
            if k is not None:
                return ("T@", k), (self.trace.stand_in(k) if self.trace else None)
            k = self.by_id[id(v)] = len(self.leaves)
            self.leaves.append(v)
            if self.trace is None:
                return ("T", v.dim(), v.dtype), None
            return ("T", v.dim(), v.dtype), self.trace.new_stand_in(k, name, v)
        if t is types.FunctionType:
            return self.function(v)
        if t is tuple or t is list:
            parts = [self.value(x, f"{name}_{n}") for n, x in enumerate(v)]
            new = t(p[1] for p in parts) if self.trace else None
            return (t, tuple(p[0] for p in parts)), new
        if t is dict:
            parts = [(k, self.value(x, f"{name}_{k}" if isinstance(k, str) else f"{name}_{n}"))
                     for n, (k, x) in enumerate(v.items())]
            if not all(type(k) in _ATOMS for k, _ in parts) and self.trace is None:
                raise Uncacheable
            new = {k: p[1] for k, p in parts} if self.trace else None
            return (dict, tuple((k, p[0]) for k, p in parts)), new
        if t is types.ModuleType:
            return ("M", v.__name__), v
        try:
            hash(v)
        except TypeError:
            if self.trace is None:
                raise Uncacheable from None
            return None, v  # read as it is; the conversion is not cached
        return ("O", v), v  # by identity; the key keeps the object alive

    def function(self, fn):
        if fn in self.funcs:
            done = self.funcs[fn]
            return (("F@", fn.__code__), fn) if done is None else done
        self.funcs[fn] = None
        code = fn.__code__
        ckeys, cells = [], []
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                val = cell.cell_contents
            except ValueError:
                ckeys.append(None)
                cells.append(cell)
                continue
            k, new = self.value(val, name)
            ckeys.append(k)
            cells.append(types.CellType(new) if self.trace else None)
        g = fn.__globals__
        gkeys, gnew = [], {}
        for name in _global_names(code):
            if name in g:
                k, new = self.value(g[name], name)
                gkeys.append((name, k))
                gnew[name] = new
        dkey = self.value(fn.__defaults__, "default")[0] if fn.__defaults__ else None
        key = ("F", code, tuple(ckeys), tuple(gkeys), dkey)
        copy = None
        if self.trace:
            glob = dict(g)
            glob.update(gnew)
            copy = types.FunctionType(code, glob, fn.__name__, fn.__defaults__,
                                      tuple(cells) if fn.__closure__ else None)
            copy.__kwdefaults__ = fn.__kwdefaults__
        self.funcs[fn] = (key, copy)
        return key, copy


def function_key(fn, walk: Walk | None = None):
    """The key of a plain function; raises Uncacheable where a value cannot be keyed."""
    return (walk or Walk()).function(fn)[0]
