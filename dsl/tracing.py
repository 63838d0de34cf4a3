"""What the mask_mod reader (``compilemask.dsl.flex``) and the score_mod reader
(``compilemask.dsl.score_mod``) share: traced values that refuse Python control flow and untraced
torch functions, and the user's line for an error."""

from __future__ import annotations

import os
import sys

import sympy as sp
import torch

__all__ = ["TracedOps", "find_trace", "user_line", "Q_INDEX", "KV_INDEX", "RELATIONS"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

# q_idx and kv_idx as both readers trace them
Q_INDEX = sp.Symbol("i", integer=True, nonnegative=True)
KV_INDEX = sp.Symbol("j", integer=True, nonnegative=True)
# a traced comparison's relation, by its operator
RELATIONS = {"<": sp.Lt, "<=": sp.Le, ">": sp.Gt, ">=": sp.Ge, "==": sp.Eq, "!=": sp.Ne}


def user_line(here: str) -> str:
    """file:line of the innermost frame of user code (not ``here``, this module or torch)."""
    skip = {os.path.abspath(here), os.path.abspath(__file__)}
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if fn not in skip and not fn.startswith(_TORCH_DIR):
            return f"{f.f_code.co_filename}:{f.f_lineno}"
        f = f.f_back
    return "?"


def find_trace(args):
    """The trace of the first traced value among ``args`` (nested tuples and lists too)."""
    for a in args:
        if isinstance(a, TracedOps):
            return a.tr
        if isinstance(a, (tuple, list)):
            tr = find_trace(a)
            if tr is not None:
                return tr
    return None


class TracedOps:
    """A traced value's refusals; ``FUNCS`` (torch function -> ``handler(tr, *args,
    **kwargs)``) is the torch spelling a reader translates, ``UNCAPTURED`` its message for a
    tensor that reaches a torch function without being a captured one (``{name}``: the
    function)."""

    __slots__ = ()
    FUNCS: dict = {}
    UNCAPTURED = "a tensor the trace does not know, in '{name}'"

    def __bool__(self):
        raise self.tr.fail("data-dependent Python control flow (bool() of a traced value: "
                           "'if', 'and', 'or', 'not', min/max builtins); use torch.where, &, |, ~")

    def __index__(self):
        raise self.tr.fail("a traced value used as a Python number")

    __int__ = __float__ = __index__

    def __hash__(self):
        return id(self)

    def __iter__(self):
        raise self.tr.fail("iteration over a traced value")

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = find_trace([*args, *kwargs.values()])
        fn = cls.FUNCS.get(func)
        if fn is None:
            name = getattr(func, "__name__", repr(func))
            if any(isinstance(a, torch.Tensor) for a in args):
                raise tr.fail(cls.UNCAPTURED.format(name=name))
            raise tr.fail(f"torch function '{name}'")
        try:
            return fn(tr, *args, **kwargs)
        except TypeError as err:  # a keyword or an arity the translation does not read
            if tr is None:
                raise
            name = getattr(func, "__name__", repr(func))
            raise tr.fail(f"torch function '{name}' with these arguments ("
                          f"{str(err).replace('<lambda>() ', '')})") from err
