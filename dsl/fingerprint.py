"""What a Python function can read, as a hashable key: its code, closure cells, the globals and
builtins its code loads and its positional and keyword-only defaults, recursively through the
functions, bound methods, tuples, lists and dicts it holds.

Ints and other atoms are keyed by value, tensors by rank and dtype (their values are runtime
data), other hashable objects without state by identity. An object whose attributes can change
(an instance of a Python class, an ``nn.Module``, a class, a module) is keyed by the values the
code reads from it: each ``x.a.b`` chain the bytecode loads from a closure cell, a global, a
default or a method's ``self`` is looked up without running user code (instance dict, class,
slots, ``nn.Module``'s parameters, buffers and submodules). Where that is not possible (the object
itself is passed on, stored or subscripted, a property, a custom ``__getattr__``, a tensor read
as an attribute) the function is :class:`Uncacheable` and its callers convert it again.

``compile_mask`` caches compiled specs by these keys, and ``from_mask_mod`` caches conversions by
them; ``Walk(trace)`` also builds a copy of each function in which captured tensors (closure
cells, globals, defaults) are the trace's stand-ins.
"""

from __future__ import annotations

import dis
import functools
import types

import torch

from compilemask.contract.lru import LRU

__all__ = ["Walk", "Uncacheable", "function_key", "numpy_scalar"]


class Uncacheable(Exception):
    """A captured value that cannot be part of a cache key (unhashable, not a container, or an
    object whose reads cannot be listed)."""


_ATOMS = (int, bool, float, str, complex, type(None), torch.dtype, torch.device)
# NumPy scalars (np.int64, np.int32, np.bool_, np.float32 ...) read as the Python number of
# their value, as torch reads them next to a tensor (a weak scalar, not a 0-d tensor)
_NUMPY_KINDS = frozenset("biuf")
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python (its attributes can change)
_MISSING = object()
_NO_SELF = object()
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_SKIP_OPS = frozenset({"EXTENDED_ARG", "NOP", "CACHE"})
_CELL_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})  # and every LOAD_FAST* spelling
_BUILTIN_METHODS = (types.BuiltinMethodType, types.MethodWrapperType)
# keyed by what they hold or read, never as objects with state
_KEYED_BY_VALUE = frozenset({types.FunctionType, types.MethodType, tuple, list, dict,
                             functools.partial})
_USES = LRU(4096)  # code object -> _Uses; bounded: exec'd or rebuilt code is new code


class _Uses:
    """What a code object loads, in the order a walk keys it: the attribute chains read from
    each closure cell (``free``, aligned with ``co_freevars``), global (``globals``) and argument
    (``params``), and whether it imports."""

    __slots__ = ("free", "globals", "params", "imports")

    def __init__(self, code):
        found = _analyze(code)
        self.free = tuple(found.get(("f", n), ()) for n in code.co_freevars)
        self.globals = tuple((n, c) for (k, n), c in found.items() if k == "g")
        self.params = {n: c for (k, n), c in found.items() if k == "p"}
        self.imports = ("import", None) in found


def _uses(code) -> _Uses:
    got = _USES.get(code)
    if got is None:
        got = _USES[code] = _Uses(code)
    return got


def _analyze(code) -> dict:
    """``{(kind, name): (attribute chain, ...)}`` for each name the code (and its nested code)
    loads: kind "g" a global, "f" a closure cell, "p" an argument; a chain is the tuple of
    attribute names loaded right after the name, ``()`` for the bare value. ``("import", None)``
    marks an import (a module read at run time)."""
    nargs = code.co_argcount + code.co_kwonlyargcount
    params = set(code.co_varnames[:nargs])
    free = set(code.co_freevars)
    out: dict = {}

    def add(key, chain):
        out.setdefault(key, {})[chain] = None

    ins = [i for i in dis.get_instructions(code) if i.opname not in _SKIP_OPS]
    for n, ins_n in enumerate(ins):
        op = ins_n.opname
        if op in ("IMPORT_NAME", "IMPORT_FROM"):
            add(("import", None), ())
            continue
        if op in ("LOAD_GLOBAL", "LOAD_NAME"):
            key = ("g", ins_n.argval)
        elif op.startswith("LOAD_FAST") or op in _CELL_LOADS:
            names = ins_n.argval if isinstance(ins_n.argval, tuple) else (ins_n.argval,)
            if len(names) > 1:  # two loads in one instruction: bare values
                for name in names:
                    if name in params:
                        add(("p", name), ())
                continue
            name = names[0]
            key = ("f", name) if name in free else ("p", name) if name in params else None
            if key is None:  # a local
                continue
        else:
            continue
        chain = []
        k = n + 1
        while k < len(ins) and ins[k].opname in _ATTR_OPS:
            chain.append(ins[k].argval)
            k += 1
        add(key, tuple(chain))
    for c in code.co_consts:
        if not isinstance(c, types.CodeType):
            continue
        # a nested function reads the enclosing function's cells by name
        for (kind, name), chains in _analyze(c).items():
            if kind in ("g", "import"):
                key = (kind, name)
            elif kind == "f" and name in free:
                key = ("f", name)
            elif kind == "f" and name in params:
                key = ("p", name)
            else:
                continue
            for chain in chains:
                add(key, chain)
    return {k: tuple(v) for k, v in out.items()}


def _stateful(v) -> bool:
    """Whether ``v`` has attributes that can change after it is keyed: a module, a class defined
    in Python, an instance of one, or an object with an instance dict. Functions and bound
    methods are keyed by what they read instead."""
    t = type(v)
    if t is types.ModuleType:
        return True
    if t in _KEYED_BY_VALUE or isinstance(v, torch.Tensor):
        return False  # a tensor is metadata: the trace reads it through its stand-in
    if isinstance(v, type):
        return bool(v.__flags__ & _HEAPTYPE)
    return bool(t.__flags__ & _HEAPTYPE) or t.__dictoffset__ != 0


def numpy_scalar(v):
    """The Python number of a NumPy scalar ``v`` (``np.int64(8)`` -> ``8``), else None."""
    if type(v).__module__ != "numpy" or getattr(getattr(v, "dtype", None), "kind",
                                                None) not in _NUMPY_KINDS:
        return None
    if getattr(v, "ndim", None) != 0 or not hasattr(v, "item"):
        return None
    return v.item()


def _lookup(cls, name):
    for c in cls.__mro__:
        d = c.__dict__
        if name in d:
            return d[name]
    return _MISSING


def _static_attr(obj, name):
    """``getattr(obj, name)`` without running user code, or Uncacheable where it would (a
    property, a custom ``__getattr__``); ``_MISSING`` where the attribute does not exist."""
    if isinstance(obj, types.ModuleType):
        d = obj.__dict__
        if name in d:
            return d[name]
        if "__getattr__" in d:  # computed module attributes
            raise Uncacheable
        return _MISSING
    if isinstance(obj, type):
        meta = _lookup(type(obj), name)
        if meta is not _MISSING and hasattr(type(meta), "__get__"):
            raise Uncacheable  # a metaclass descriptor (__name__, ...)
        a = _lookup(obj, name)
        if a is _MISSING:
            if _lookup(type(obj), "__getattr__") is not _MISSING:
                raise Uncacheable
            return meta  # a plain metaclass attribute, or _MISSING
        ta = type(a)
        if ta is staticmethod:
            return a.__func__
        if ta is classmethod:
            return types.MethodType(a.__func__, obj)
        if ta is types.FunctionType or not hasattr(ta, "__get__"):
            return a
        raise Uncacheable
    cls = type(obj)
    if cls.__getattribute__ is not object.__getattribute__:
        raise Uncacheable
    found = _lookup(cls, name)
    tf = type(found)
    if found is not _MISSING and (hasattr(tf, "__set__") or hasattr(tf, "__delete__")):
        # a data descriptor wins over the instance dict: a slot is read, anything else computed
        if tf is not types.MemberDescriptorType:
            raise Uncacheable
        try:
            return found.__get__(obj, cls)
        except AttributeError:  # an unset slot: Python asks __getattr__ next
            return _missing(cls)
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        d = None
    if d is not None and name in d:
        return d[name]
    if found is not _MISSING:
        if tf is types.FunctionType:
            return types.MethodType(found, obj)
        if tf is staticmethod:
            return found.__func__
        if tf is classmethod:
            return types.MethodType(found.__func__, cls)
        if hasattr(tf, "__get__"):
            raise Uncacheable
        return found
    if _lookup(cls, "__getattr__") is torch.nn.Module.__getattr__ and d is not None:
        for registry in ("_parameters", "_buffers", "_modules"):
            r = d.get(registry)
            if r is not None and name in r:
                return r[name]
        return _MISSING
    return _missing(cls)


def _missing(cls):
    """An attribute the usual lookup did not find: missing, unless a ``__getattr__`` computes
    it."""
    if _lookup(cls, "__getattr__") is _MISSING:
        return _MISSING
    raise Uncacheable


class Walk:
    """One walk: the key of everything a mask_mod can read, the tensors in walk order and, when
    tracing, a copy of each function whose tensors are stand-ins."""

    def __init__(self, trace=None):
        self.trace = trace
        self.leaves: list[torch.Tensor] = []
        self.by_id: dict[int, int] = {}
        self.funcs: dict = {}  # function (or (function, id(self))) -> (key, copy); None: walking
        self.via_attr = 0  # > 0 while keying a value read through an attribute chain

    def value(self, v, name):
        t = type(v)
        if t in _ATOMS:
            return (t, v), v
        py = numpy_scalar(v)
        if py is not None:
            return (type(py), py), py
        if isinstance(v, torch.Tensor):
            if self.via_attr:
                # the trace reads an attribute's tensor as it is (its values, not a stand-in)
                raise Uncacheable
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
        if t is functools.partial:  # functools.partial(fn, ...): keyed by fn and what it binds
            fkey, fnew = self.value(v.func, name)
            args = [self.value(x, f"{name}_{n}") for n, x in enumerate(v.args)]
            kws = [(k, self.value(x, k)) for k, x in v.keywords.items()]
            key = ("P", fkey, tuple(a[0] for a in args), tuple((k, p[0]) for k, p in kws))
            new = (functools.partial(fnew, *(a[1] for a in args), **{k: p[1] for k, p in kws})
                   if self.trace else None)
            return key, new
        if t is types.MethodType:
            if type(v.__func__) is not types.FunctionType:
                if self.trace is None:
                    raise Uncacheable
                return None, v
            key, copy = self.function(v.__func__, v.__self__)
            return ("BM", key), (types.MethodType(copy, v.__self__) if self.trace else None)
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
        if _stateful(v) or (t in _BUILTIN_METHODS and _stateful(v.__self__)
                            and not isinstance(v.__self__, types.ModuleType)):
            # read other than through attribute chains (passed on, stored, subscripted, a
            # builtin method of it): what is read from it cannot be listed
            if self.trace is None:
                raise Uncacheable
            return None, v
        try:
            hash(v)
        except TypeError:
            if self.trace is None:
                raise Uncacheable from None
            return None, v  # read as it is; the conversion is not cached
        return ("O", v), v  # stateless: by identity; the key keeps the object alive

    def root(self, v, name, chains):
        """A value the code loads by name: a stateful object is keyed by the attribute chains
        the code reads from it, anything else by value."""
        t = type(v)
        if t in _ATOMS:
            return (t, v), v
        py = numpy_scalar(v)
        if py is not None:
            return (type(py), py), py
        if (self.trace is not None or t in _KEYED_BY_VALUE or isinstance(v, torch.Tensor)
                or not _stateful(v)):
            return self.value(v, name)
        if () in chains:
            raise Uncacheable
        return ("S", tuple((c, self.chain(v, c)) for c in chains)), v

    def chain(self, v, attrs):
        for a in attrs:
            if not (_stateful(v) or type(v) in (types.FunctionType, types.MethodType)):
                break  # the key of a stateless value covers what is read from it
            v = _static_attr(v, a)
            if v is _MISSING:
                return ("missing", a)  # reading it raises, so nothing is cached
        if _stateful(v):
            raise Uncacheable  # the object itself is used
        self.via_attr += 1
        try:
            return self.value(v, attrs[-1])[0]
        finally:
            self.via_attr -= 1

    def function(self, fn, bound=_NO_SELF):
        fid = fn if bound is _NO_SELF else (fn, id(bound))
        if fid in self.funcs:
            done = self.funcs[fid]
            return (("F@", fn.__code__), fn) if done is None else done
        self.funcs[fid] = None
        code = fn.__code__
        uses = _uses(code)
        if self.trace is None and uses.imports:
            raise Uncacheable  # a module imported as the code runs is not a captured value
        params = uses.params
        bkey = None
        if bound is not _NO_SELF:
            if code.co_argcount:
                pname = code.co_varnames[0]
                bkey = self.root(bound, pname, params.get(pname, ()))[0]
            else:
                bkey = self.value(bound, "self")[0]
        ckeys, cells = [], []
        for name, chains, cell in zip(code.co_freevars, uses.free, fn.__closure__ or ()):
            try:
                val = cell.cell_contents
            except ValueError:
                ckeys.append(None)
                cells.append(cell)
                continue
            k, new = self.root(val, name, chains)
            ckeys.append(k)
            cells.append(types.CellType(new) if self.trace else None)
        g = fn.__globals__
        builtins = fn.__builtins__
        gkeys, gnew = [], {}
        for name, chains in uses.globals:
            if name in g:
                k, new = self.root(g[name], name, chains)
                gkeys.append((name, k))
                gnew[name] = new
            elif self.trace is None and name in builtins:
                self.via_attr += 1  # not traced: a tensor here would be read as it is
                try:
                    gkeys.append((name, "builtin", self.root(builtins[name], name, chains)[0]))
                finally:
                    self.via_attr -= 1
        dkey = dnew = None
        if fn.__defaults__:
            d = fn.__defaults__
            names = code.co_varnames[code.co_argcount - len(d):code.co_argcount]
            parts = [self.root(v, n, params.get(n, ())) for n, v in zip(names, d)]
            dkey = tuple(p[0] for p in parts)
            dnew = tuple(p[1] for p in parts) if self.trace else None
        kkey = knew = None
        if fn.__kwdefaults__:
            parts = [(n, self.root(v, n, params.get(n, ())))
                     for n, v in fn.__kwdefaults__.items()]
            kkey = tuple((n, p[0]) for n, p in parts)
            knew = {n: p[1] for n, p in parts} if self.trace else None
        key = ("F", code, bkey, tuple(ckeys), tuple(gkeys), dkey, kkey)
        copy = None
        if self.trace:
            glob = dict(g)
            glob.update(gnew)
            copy = types.FunctionType(code, glob, fn.__name__, dnew,
                                      tuple(cells) if fn.__closure__ else None)
            copy.__kwdefaults__ = knew
        self.funcs[fid] = (key, copy)
        return key, copy


def function_key(fn, walk: Walk | None = None):
    """The key of a plain function; raises Uncacheable where a value cannot be keyed."""
    return (walk or Walk()).function(fn)[0]
