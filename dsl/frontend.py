"""Front end: plain Python rule functions -> sympy expressions (compiler pass 1).

A rule is read from its source (``ast``), never executed. Names resolve, in this order, to the
function's arguments (``i``, ``j``), local assignments, declared params (runtime symbols),
``seqlen_q``/``seqlen_k``, and globals or closure cells holding ints (compile-time constants) or
plain helper functions (inlined); ``h``, where nothing else binds it, is the query head (a
per-head mask). Anything else is an error that names the region, the function, the name and its
source line. ``~`` of a boolean is not, as on torch bool tensors, where the value is a tensor when
the rule runs on tensors; on a value that can be a Python bool (``~(not c)``, ``~FLAG``), where
Python computes it bitwise, it is refused.
"""

from __future__ import annotations

import ast
import builtins
import dis
import inspect
import linecache
import textwrap
import types
from dataclasses import dataclass, field

import sympy as sp

from compilemask.contract.lru import LRU

__all__ = [
    "HEAD_INDEX",
    "HeadIndexRead",
    "RuleContext",
    "TranslatedRule",
    "SourceMatchError",
    "translate_rule",
    "rule_symbols",
    "array_function",
    "table_function",
    "is_table_read",
    "bool_xor",
    "boolean_basis",
    "IntBitOp",
    "BitAnd",
    "BitOr",
    "BitXor",
    "int_bit_op",
    "shift",
]

_MAX_INLINE_DEPTH = 16


def bool_xor(a, b):
    """``a ^ b`` of booleans with And / Or / Not: sympy's Xor breaks inside a Piecewise
    condition, and the printers spell only those three."""
    return sp.Or(sp.And(a, sp.Not(b)), sp.And(sp.Not(a), b))


def boolean_basis(e):
    """Xor, ITE, Implies and Equivalent rewritten with And / Or / Not at every depth (also in a
    Piecewise condition inside an atom), the connectives every printer spells."""
    if not isinstance(e, sp.Basic) or not e.args:
        return e
    args = [boolean_basis(a) for a in e.args]
    if isinstance(e, sp.Xor):
        out = args[0]
        for b in args[1:]:
            out = bool_xor(out, b)
        return out
    if isinstance(e, sp.ITE):
        c, a, b = args
        return sp.Or(sp.And(c, a), sp.And(sp.Not(c), b))
    if isinstance(e, sp.Implies):
        return sp.Or(sp.Not(args[0]), args[1])
    if isinstance(e, sp.Equivalent):
        return sp.Or(sp.And(*args), sp.And(*[sp.Not(a) for a in args]))
    return e.func(*args) if any(a is not b for a, b in zip(args, e.args)) else e


class IntBitOp(sp.Function):
    """``a & b``, ``a | b``, ``a ^ b`` of integers, as Python and torch's int64 compute them
    (two's complement): opaque to the interval passes (an atom reading one in ``j`` stays a
    predicate; one in ``i`` only is a row term the preprocess evaluates), spelled by every
    printer, uninterpreted (with true bounds for non-negative operands) in the prover."""

    is_integer = True
    nargs = 2
    op = ""

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sp.Integer(cls.py(int(a), int(b)))
        return None


class BitAnd(IntBitOp):
    op = "&"

    @staticmethod
    def py(a, b):
        return a & b


class BitOr(IntBitOp):
    op = "|"

    @staticmethod
    def py(a, b):
        return a | b


class BitXor(IntBitOp):
    op = "^"

    @staticmethod
    def py(a, b):
        return a ^ b


_INT_BIT_OPS = {"&": BitAnd, "|": BitOr, "^": BitXor}


def int_bit_op(sym: str, a, b):
    """The integer bit operation ``a sym b`` (``&``, ``|``, ``^``)."""
    return _INT_BIT_OPS[sym](a, b)


def shift(sym: str, a, k):
    """``a >> k`` / ``a << k`` for a constant ``k`` in [0, 62]: exactly ``a // 2**k`` and
    ``a * 2**k`` for every integer (Python's and torch's int64 rule), which the interval passes
    read like any other quotient or product; the error message (a str) otherwise."""
    if not (isinstance(k, sp.Integer) or isinstance(k, int)) or not 0 <= int(k) <= 62:
        return f"shift by {k}: a constant in [0, 62]"
    return sp.floor(a / 2 ** int(k)) if sym == ">>" else a * 2 ** int(k)


_BOOL_OPS_SYM = {ast.BitAnd: ("&", sp.And), ast.BitOr: ("|", sp.Or), ast.BitXor: ("^", bool_xor)}
_BOOL_OPS = tuple(_BOOL_OPS_SYM)


# A rule reading ``h`` where no param, variable or builtin of that name exists reads the query
# head: ``compile_mask`` then makes it a scalar param that per-head preprocessing fills.
HEAD_INDEX = "h"


class HeadIndexRead(ValueError):
    """A rule read the head index ``h`` without a param of that name."""


def rule_symbols(params) -> dict[str, sp.Symbol]:
    """The symbol table shared by every pass: rows, keys, lengths and params are integers."""
    syms = {
        "i": sp.Symbol("i", integer=True, nonnegative=True),
        "j": sp.Symbol("j", integer=True, nonnegative=True),
        "seqlen_q": sp.Symbol("seqlen_q", integer=True, positive=True),
        "seqlen_k": sp.Symbol("seqlen_k", integer=True, positive=True),
    }
    for p in params:
        syms[p] = sp.Symbol(p, integer=True, nonnegative=True)
    return syms


def array_function(name: str, nonnegative: bool = True):
    """A per-row metadata array ``name[i]`` is the integer-valued function ``name(i)``;
    ``nonnegative=False`` where its values may still be negative when it is read (a mask_mod's
    captured tensor, whose rules must not fold ``t[q_idx] >= 0`` away)."""
    return sp.Function(name, integer=True, **({"nonnegative": True} if nonnegative else {}))


def table_function(name: str):
    """A table param read at the row and a column, ``name[i, c]``, is ``name(i, c)``: 1 where
    row ``i``'s entry at column ``c`` is nonzero, 0 elsewhere and at columns outside the table."""
    return sp.Function(name, integer=True, nonnegative=True)


def is_table_read(e) -> bool:
    """Whether ``e`` is a table read (a two-index function application)."""
    return isinstance(e, sp.core.function.AppliedUndef) and len(e.args) == 2


def _truth(e):
    """A table read used as a condition: its entry is nonzero (as a bool tensor reads)."""
    return sp.Ne(e, 0) if is_table_read(e) else e


@dataclass
class RuleContext:
    """Where a rule comes from, for error messages, and what the translation discovered."""

    region: str
    role: str  # "when" or "visible"
    params: tuple[str, ...]
    symbols: dict[str, sp.Symbol]
    array_params: set[str] = field(default_factory=set)
    scalar_params: set[str] = field(default_factory=set)
    divisor_params: set[str] = field(default_factory=set)
    table_params: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class TranslatedRule:
    expr: sp.Basic  # a sympy Boolean over i, j, params, array functions
    source: str  # the rule's source text, as the user wrote it
    func_name: str


def _is_bool(e) -> bool:
    """sympy Symbols are Booleans too; a rule's booleans are relations and their combinations."""
    return isinstance(e, (sp.logic.boolalg.BooleanFunction, sp.core.relational.Relational,
                          sp.logic.boolalg.BooleanAtom))


# The env key of the local names whose value may be a Python object rather than a tensor (a
# constant, a global, ``not``/``and``/``or``): ``~`` of such a bool is bitwise in Python and torch.
_PY_LOCALS = "<python-valued locals>"


def _bind(env: dict, name: str, value, tensor: bool):
    env[name] = value
    py = env.get(_PY_LOCALS, frozenset())
    env[_PY_LOCALS] = py - {name} if tensor else py | {name}


class SourceMatchError(ValueError):
    """A rule function whose source cannot be matched to its code object unambiguously."""


_TREES = LRU(256)  # (filename, source text) -> parsed module: one parse per file version


def _parsed(filename, text):
    key = (filename, text)
    tree = _TREES.get(key)
    if tree is None:
        tree = ast.parse(text)
        _TREES[key] = tree
    return tree


def _file_tree(fn):
    """(module ast, source text, filename) for ``fn``; positions match its code object."""
    code = fn.__code__
    filename = code.co_filename
    linecache.checkcache(filename)  # a file edited (and reloaded) since it was first read
    lines = linecache.getlines(filename, fn.__globals__)
    if not lines:
        raise SourceMatchError(
            f"cannot read the source of {fn.__name__} ({filename}): rules must be defined in a "
            "file (or registered in linecache), not typed at an interactive prompt"
        )
    text = "".join(lines)
    try:
        return _parsed(filename, text), text, filename
    except SyntaxError:
        pass
    # A fragment (e.g. a notebook cell registered partially): parse the function's own lines,
    # dedented, then shift the nodes back to where the code object says they are.
    raw = inspect.getsource(fn)
    dedented = textwrap.dedent(raw)
    first = next((ln for ln in raw.splitlines() if ln.strip()), "")
    indent = len(first) - len(first.lstrip())
    tree = ast.parse(dedented)
    offset = code.co_firstlineno - 1
    for node in ast.walk(tree):
        if hasattr(node, "lineno"):
            node.lineno += offset
            node.end_lineno = (node.end_lineno or node.lineno - offset) + offset
            node.col_offset += indent
            if node.end_col_offset is not None:
                node.end_col_offset += indent
    return tree, "\n" * offset + raw, filename


def _code_positions(code) -> set:
    """Source spans (line, end_line, col, end_col) of the code's instructions; the zero-width
    ones (RESUME) and those without columns (-X no_debug_ranges) carry no location."""
    return {p for p in code.co_positions()
            if None not in p and not (p[2] == 0 and p[3] == 0)}


def _inside(pos, node) -> bool:
    line, end_line, col, end_col = pos
    return ((node.lineno, node.col_offset) <= (line, col)
            and (end_line, end_col) <= (node.end_lineno, node.end_col_offset))


# a name read, however it resolves: compiled alone, a closure variable loads as a global
_NAME_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME",
                         "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_DEREF",
                         "LOAD_FROM_DICT_OR_GLOBALS", "LOAD_FAST_LOAD_FAST"})
# what only a closure adds (its cells, the NULL a called free name needs): no computation
_SCAFFOLD = frozenset({"RESUME", "COPY_FREE_VARS", "MAKE_CELL", "PUSH_NULL", "NOP", "CACHE",
                       "EXTENDED_ARG", "LOAD_CLOSURE"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


def _instructions(code) -> tuple:
    """Every instruction of ``code`` in order with its argument, where names resolve aside:
    ``j <= i`` and ``i <= j``, ``i - w`` and ``w - i`` differ (the operands' order is the
    order of their loads); jumps by the index of their target."""
    kept, closure = [], False
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_CLOSURE":
            closure = True
        if ins.opname in _SCAFFOLD:
            continue
        if closure and ins.opname == "BUILD_TUPLE":  # the tuple of cells a closure takes
            closure = False
            continue
        closure = False
        kept.append(ins)
    index = {ins.offset: n for n, ins in enumerate(kept)}
    out = []
    for ins in kept:
        if ins.opname in _NAME_LOADS:
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            out += [("LOAD", n) for n in names]
        elif ins.opcode in _JUMPS:
            target = index.get(ins.argval)
            if target is None:  # a target dropped above: the next instruction kept
                target = next((n for n, k in enumerate(kept) if k.offset > ins.argval), -1)
            out.append((ins.opname.replace("FORWARD_", "").replace("BACKWARD_", ""), target))
        elif ins.opname == "MAKE_FUNCTION":
            out.append((ins.opname, (ins.arg or 0) & ~0x08))  # 0x08: with a closure
        elif ins.opname == "SET_FUNCTION_ATTRIBUTE" and ins.arg == 0x08:
            continue
        elif ins.opname == "LOAD_CONST":
            c = ins.argval
            out.append((ins.opname, _code_shape(c) if isinstance(c, types.CodeType)
                        else (type(c).__name__, repr(c))))
        else:
            out.append((ins.opname, ins.argrepr))
    return tuple(out)


def _code_shape(code):
    """What a code object computes apart from where names resolve: compiled alone, a closure
    variable becomes a global, so free and global names are compared as one set; its
    instructions in order (``_instructions``) tell ``j >= i - w`` from ``j <= i - w`` and from
    ``i >= j - w`` (a file edited since)."""
    consts = tuple(_code_shape(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return (code.co_argcount, code.co_varnames, consts,
            frozenset(code.co_names) | frozenset(code.co_freevars), _instructions(code))


def _node_shape(node):
    """``_code_shape`` of an ast Lambda/FunctionDef compiled on its own; None if it cannot be
    compiled out of its context."""
    try:
        if isinstance(node, ast.Lambda):
            mod = ast.Expression(body=node)
            co = compile(mod, "<cm>", "eval")
        else:
            mod = ast.Module(body=[node], type_ignores=[])
            co = compile(mod, "<cm>", "exec")
    except (SyntaxError, ValueError, TypeError):
        return None
    inner = next((c for c in co.co_consts if isinstance(c, types.CodeType)), None)
    return None if inner is None else _code_shape(inner)


def _func_source_node(fn, where: str | None = None) -> tuple[ast.AST, str, str]:
    """The ast node (FunctionDef or Lambda) of ``fn`` and its source text.

    The node is identified from the code object itself: its first line, the column spans of its
    instructions (``co_positions``) and, where several nodes remain, its constants and names.
    Several lambdas on one line are told apart this way; a function whose source cannot be
    matched unambiguously (e.g. the file changed since it was imported) is an error, never a
    guess."""
    code = fn.__code__
    who = where or f"function {fn.__name__!r}"
    try:
        tree, text, filename = _file_tree(fn)
    except SourceMatchError as e:
        raise SourceMatchError(f"{who}: {e}") from None
    first = code.co_firstlineno
    candidates = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda):
            if (code.co_name == "<lambda>" and node.lineno == first
                    and len(node.args.args) == code.co_argcount):
                candidates.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.name == code.co_name and first in (start, node.lineno):
                candidates.append(node)
    positions = _code_positions(code)
    if positions:
        candidates = [c for c in candidates if all(_inside(p, c) for p in positions)]
        # A lambda returns its body: the body's exact span is one of the code's positions
        # (this separates a lambda from a lambda nested in its body).
        bodies = [c for c in candidates if isinstance(c, ast.Lambda) and (
            c.body.lineno, c.body.end_lineno, c.body.col_offset, c.body.end_col_offset
        ) in positions]
        if bodies:
            candidates = bodies
    if len(candidates) > 1:
        want = _code_shape(code)
        candidates = [c for c in candidates if _node_shape(c) in (want, None)]
    if len(candidates) > 1:
        # identical text in one place reads the same free names: any of them is the rule
        dumps = {ast.dump(c) for c in candidates}
        if len(dumps) > 1:
            raise SourceMatchError(
                f"{who} ({filename}:{first}): {len(candidates)} functions on this line match "
                "its code object; define the rule on a line of its own"
            )
    if not candidates:
        raise SourceMatchError(
            f"{who} ({filename}:{first}): cannot locate its source; the file may have changed "
            "since it was imported"
        )
    node = candidates[0]
    if len(candidates) == 1 and _node_shape(node) not in (_code_shape(code), None):
        raise SourceMatchError(
            f"{who} ({filename}:{first}): the source at this line does not match the function's "
            "code; the file may have changed since it was imported: reload the module (e.g. "
            "importlib.reload) or restart, so that the rule that runs is the rule compiled"
        )
    src = ast.get_source_segment(text, node) if text else None
    return node, src or ast.unparse(node), filename


def _closure_vars(fn) -> dict:
    cells = {}
    if fn.__closure__:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
            try:
                cells[name] = cell.cell_contents
            except ValueError:
                pass
    return cells


class _Translator:
    def __init__(self, ctx: RuleContext, fn, filename: str, depth: int = 0):
        self.ctx = ctx
        self.fn = fn
        self.filename = filename
        self.depth = depth
        self.closure = _closure_vars(fn)
        # id(node) -> whether the node's value is a tensor when the rule runs on tensors
        # (reference_mask's 0-d tensors): set by expr() as each node is translated
        self.tensor: dict[int, bool] = {}
        self.returns_tensor = True  # every return of the function is a tensor

    # ---- errors ----------------------------------------------------------------------------
    def where(self, node) -> str:
        line = getattr(node, "lineno", "?")
        return (
            f"Region {self.ctx.region!r}, {self.ctx.role} function {self.fn.__name__!r} "
            f"({self.filename}:{line})"
        )

    def unsupported(self, node, what: str):
        return NotImplementedError(f"{self.where(node)}: unsupported {what}")

    # ---- statements ------------------------------------------------------------------------
    def block(self, stmts: list, env: dict, node_for_error) -> sp.Basic:
        for k, st in enumerate(stmts):
            if isinstance(st, ast.Return):
                if st.value is None:
                    raise self.unsupported(st, "bare 'return' (return a boolean)")
                out = self.expr(st.value, env)
                self.returns_tensor &= self.tensor[id(st.value)]
                return out
            if isinstance(st, ast.Assign):
                # Python evaluates the value once, then binds it to the targets left to right
                got = self.assigned(st.value, env)
                env = dict(env)
                for target in st.targets:
                    self.assign(target, st.value, got, env)
                continue
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value:
                got = self.expr(st.value, env)
                env = dict(env)
                _bind(env, st.target.id, got, self.tensor[id(st.value)])
                continue
            if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name):
                cur = self.name(st.target, env)
                tensor = self.name_is_tensor(st.target.id, env)
                rhs = self.expr(st.value, env)
                tensor = tensor or self.tensor[id(st.value)]
                env = dict(env)
                _bind(env, st.target.id, self.binop(st.op, cur, rhs, st), tensor)
                continue
            if isinstance(st, ast.If):
                cond = self.boolean(self.expr(st.test, env), st.test)
                rest = stmts[k + 1 :]
                then = self.block(list(st.body) + rest, env, st)
                other = self.block(list(st.orelse) + rest, env, st)
                return self.select(cond, then, other, st)
            if isinstance(st, ast.Pass):
                continue
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
                continue  # docstring
            raise self.unsupported(st, f"statement '{type(st).__name__}'")
        raise NotImplementedError(
            f"{self.where(node_for_error)}: a path through the function does not return"
        )

    def assigned(self, value, env):
        """The value of an assignment, translated once: ``(expr, is tensor)``, or a list of
        them for a tuple ``x, y``."""
        if isinstance(value, ast.Tuple):
            return [(self.expr(v, env), self.tensor[id(v)]) for v in value.elts]
        return self.expr(value, env), self.tensor[id(value)]

    def assign(self, target, value, got, env):
        """Bind ``got`` (``assigned(value)``) to ``name`` or to ``a, b`` (of a tuple value)."""
        if isinstance(target, ast.Name):
            if isinstance(got, list):
                raise self.unsupported(value, "syntax 'Tuple'")
            _bind(env, target.id, *got)
            return
        if isinstance(target, ast.Tuple) and isinstance(got, list):
            if len(target.elts) != len(got):
                raise self.unsupported(target, "tuple assignment of unequal lengths")
            for t in target.elts:
                if not isinstance(t, ast.Name):
                    raise self.unsupported(t, "assignment target (only names)")
            for t, (v, tensor) in zip(target.elts, got):
                _bind(env, t.id, v, tensor)
            return
        raise self.unsupported(target, "assignment target (only 'name = expr' or 'a, b = x, y')")

    def select(self, cond, then, other, node):
        if _is_bool(then) or _is_bool(other):
            then, other = _truth(then), _truth(other)
        if _is_bool(then) and _is_bool(other):
            return sp.Or(sp.And(cond, then), sp.And(sp.Not(cond), other))
        if _is_bool(then) or _is_bool(other):
            raise self.unsupported(node, "conditional mixing booleans and integers")
        return sp.Piecewise((then, cond), (other, True))

    def boolean(self, e, node):
        e = _truth(e)
        if _is_bool(e):
            return e
        raise self.unsupported(node, "integer used as a condition (compare it explicitly)")

    def integer(self, e, node):
        if _is_bool(e):
            raise self.unsupported(node, "boolean used in arithmetic")
        return e

    # ---- expressions -----------------------------------------------------------------------
    def expr(self, node, env) -> sp.Basic:
        out = self.translate(node, env)
        self.tensor[id(node)] = self.is_tensor(node, env)
        return out

    def is_tensor(self, node, env) -> bool:
        """Whether the value of ``node`` (its operands just translated) is a tensor when the rule
        runs on tensors for ``i``, ``j``, the params and lengths, as Python evaluates it:
        constants and globals are Python objects, ``not`` gives a Python bool, ``and``/``or``/
        ``min``/``max``/``x if c else y`` give one of their operands, an operation with a
        tensor operand gives a tensor."""
        def sub(n):
            return self.tensor.get(id(n), False)

        if isinstance(node, ast.Name):
            return self.name_is_tensor(node.id, env)
        if isinstance(node, ast.Subscript):
            return True  # params' entries
        if isinstance(node, ast.UnaryOp):
            return not isinstance(node.op, ast.Not) and sub(node.operand)
        if isinstance(node, ast.BinOp):
            return sub(node.left) or sub(node.right)
        if isinstance(node, ast.Compare):
            # a chained comparison is an 'and' of its pairs: one of them is the value
            ops = [node.left, *node.comparators]
            return all(sub(a) or sub(b) for a, b in zip(ops, ops[1:]))
        if isinstance(node, ast.BoolOp):
            return all(sub(v) for v in node.values)
        if isinstance(node, ast.IfExp):
            return sub(node.body) and sub(node.orelse)
        if isinstance(node, ast.Call):
            return sub(node)  # set by call()
        return False

    def name_is_tensor(self, name, env) -> bool:
        if name in env:
            return name not in env.get(_PY_LOCALS, ())
        return name in self.ctx.params or name in ("seqlen_q", "seqlen_k")

    def translate(self, node, env) -> sp.Basic:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool):
                return sp.true if node.value else sp.false
            if isinstance(node.value, int):
                return sp.Integer(node.value)
            raise self.unsupported(node, f"constant {node.value!r} (only ints and booleans)")
        if isinstance(node, ast.Name):
            return self.name(node, env)
        if isinstance(node, ast.BoolOp):
            vals = [self.boolean(self.expr(v, env), v) for v in node.values]
            return sp.And(*vals) if isinstance(node.op, ast.And) else sp.Or(*vals)
        if isinstance(node, ast.UnaryOp):
            v = self.expr(node.operand, env)
            if isinstance(node.op, ast.Not):
                return sp.Not(self.boolean(v, node))
            if isinstance(node.op, ast.Invert):
                # logical not on booleans, as on torch bool tensors; on an int it is bitwise
                v = _truth(v)
                if _is_bool(v):
                    if not self.tensor[id(node.operand)]:
                        raise self.invert_of_python_bool(node)
                    return sp.Not(v)
                return -self.integer(v, node) - 1  # on an integer: bitwise not, -v - 1
            if isinstance(node.op, ast.USub):
                return -self.integer(v, node)
            if isinstance(node.op, ast.UAdd):
                return self.integer(v, node)
            raise self.unsupported(node, f"operator '{type(node.op).__name__}'")
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BOOL_OPS):
            return self.bool_binop(node, env)
        if isinstance(node, ast.BinOp):
            a = self.integer(self.expr(node.left, env), node.left)
            b = self.integer(self.expr(node.right, env), node.right)
            return self.binop(node.op, a, b, node)
        if isinstance(node, ast.Compare):
            terms = []
            left = self.integer(self.expr(node.left, env), node.left)
            for op, comp in zip(node.ops, node.comparators):
                right = self.integer(self.expr(comp, env), comp)
                terms.append(self.compare(op, left, right, node))
                left = right
            return sp.And(*terms)
        if isinstance(node, ast.IfExp):
            cond = self.boolean(self.expr(node.test, env), node.test)
            return self.select(cond, self.expr(node.body, env), self.expr(node.orelse, env), node)
        if isinstance(node, ast.Call):
            return self.call(node, env)
        if isinstance(node, ast.Subscript):
            return self.subscript(node, env)
        raise self.unsupported(node, f"syntax '{type(node).__name__}'")

    def invert_of_python_bool(self, node):
        # Python (and torch) compute ~ of a Python bool bitwise: ~True == -2, ~False == -1,
        # both true, so reading it as logical not would compile another mask
        operand = ast.unparse(node.operand)
        return self.unsupported(
            node, f"'~' of '{operand}', which can be a Python bool (from 'not', 'and'/'or', a "
                  "constant or global, or a comparison without i, j, a param or a length): on a "
                  "Python bool '~' is bitwise (~True == -2, ~False == -1, both true), not "
                  f"logical; write 'not ({operand})'")

    def bool_binop(self, node, env):
        """``&``, ``|``, ``^`` of booleans are and, or, xor (as on torch bool tensors)."""
        a, b = self.expr(node.left, env), self.expr(node.right, env)
        sym, combine = _BOOL_OPS_SYM[type(node.op)]
        if _is_bool(a) or _is_bool(b) or is_table_read(a) and is_table_read(b):
            a, b = _truth(a), _truth(b)  # a table's entries are booleans next to a condition
        if _is_bool(a) and _is_bool(b):
            return combine(a, b)
        if not _is_bool(a) and not _is_bool(b):  # integers: the bit operation
            return int_bit_op(sym, self.integer(a, node.left), self.integer(b, node.right))
        raise self.unsupported(node, f"'{sym}' of a boolean and an integer: parenthesize "
                                     f"comparisons, e.g. (j < i) {sym} (j > 2)")

    def binop(self, op, a, b, node):
        if isinstance(op, ast.Add):
            return a + b
        if isinstance(op, ast.Sub):
            return a - b
        if isinstance(op, ast.Mult):
            return a * b
        if isinstance(op, (ast.FloorDiv, ast.Mod)):
            self.check_divisor(b, node)
            return sp.floor(a / b) if isinstance(op, ast.FloorDiv) else sp.Mod(a, b)
        if isinstance(op, ast.Div):
            raise self.unsupported(node, "true division '/' (use '//')")
        if isinstance(op, (ast.RShift, ast.LShift)):
            out = shift(">>" if isinstance(op, ast.RShift) else "<<", a, b)
            if isinstance(out, str):
                raise self.unsupported(node, out)
            return out
        raise self.unsupported(node, f"operator '{type(op).__name__}'")

    def check_divisor(self, b, node):
        if b.is_Integer:
            if int(b) <= 0:
                raise ValueError(f"{self.where(node)}: divisor {b} must be positive")
            return
        if b.is_Symbol and b.name in self.ctx.params:
            self.ctx.divisor_params.add(b.name)
            return
        raise self.unsupported(node, f"divisor '{b}' (a positive constant or a param)")

    def compare(self, op, a, b, node):
        table = {
            ast.Lt: sp.Lt,
            ast.LtE: sp.Le,
            ast.Gt: sp.Gt,
            ast.GtE: sp.Ge,
            ast.Eq: sp.Eq,
            ast.NotEq: sp.Ne,
        }
        for k, f in table.items():
            if isinstance(op, k):
                return f(a, b)
        raise self.unsupported(node, f"comparison '{type(op).__name__}'")

    def call(self, node, env):
        if node.keywords:
            raise self.unsupported(node, "keyword arguments in a call")
        if not isinstance(node.func, ast.Name):
            raise self.unsupported(node, f"call of '{ast.unparse(node.func)}'")
        fname = node.func.id
        args = [self.expr(a, env) for a in node.args]
        tensors = [self.tensor[id(a)] for a in node.args]
        target = self.lookup(fname, env, node, allow_function=True)
        if target is builtins.min or target is builtins.max:
            if len(args) < 2:
                raise self.unsupported(node, f"{fname}() with fewer than two arguments")
            args = [self.integer(a, node) for a in args]
            self.tensor[id(node)] = all(tensors)  # the value is one of the arguments
            return sp.Min(*args) if target is builtins.min else sp.Max(*args)
        if target is builtins.abs:
            if len(args) != 1:
                raise self.unsupported(node, "abs() takes one argument")
            self.tensor[id(node)] = tensors[0]
            return sp.Abs(self.integer(args[0], node))
        if isinstance(target, types.FunctionType):
            if self.depth >= _MAX_INLINE_DEPTH:
                raise self.unsupported(node, f"helper nesting deeper than {_MAX_INLINE_DEPTH}")
            out, self.tensor[id(node)] = _inline(target, args, tensors, self.ctx,
                                                 self.depth + 1, node, self)
            return out
        raise self.unsupported(node, f"call to '{fname}' (not min/max/abs or a plain function)")

    def subscript(self, node, env):
        if not isinstance(node.value, ast.Name) or node.value.id not in self.ctx.params:
            raise self.unsupported(node, f"subscript '{ast.unparse(node)}' (only param[i])")
        name = node.value.id
        if name in self.ctx.scalar_params:
            raise ValueError(f"{self.where(node)}: param {name!r} is used both as a scalar and "
                             "as a per-row array")
        if isinstance(node.slice, ast.Tuple):
            return self.table_read(node, name, env)
        if name in self.ctx.table_params:
            raise ValueError(f"{self.where(node)}: param {name!r} is a table: read it as "
                             f"{name}[i, column]")
        idx = self.integer(self.expr(node.slice, env), node.slice)
        # every pass reads a per-row array at the row or the key only; refuse anything else
        # here, where the rule and its line are known
        if idx not in (self.ctx.symbols["i"], self.ctx.symbols["j"]):
            written = ast.unparse(node.slice)
            shown = "" if str(idx) == written else f" (the index reads {idx})"
            raise self.unsupported(
                node, f"subscript '{ast.unparse(node)}'{shown}: a per-row array is read at i or "
                      f"j only ({name}[i], {name}[j])")
        self.ctx.array_params.add(name)
        return array_function(name)(idx)

    def table_read(self, node, name, env):
        """``t[i, c]``: a table param (``[B, Sq, M]`` metadata: row i's M entries) at column
        ``c``, an integer expression of ``j``; its regions keep it as their predicate."""
        written = ast.unparse(node)
        elts = node.slice.elts
        if len(elts) != 2:
            raise self.unsupported(node, f"subscript '{written}': a table is read as "
                                         f"{name}[i, column]")
        if name in self.ctx.array_params:
            raise ValueError(f"{self.where(node)}: param {name!r} is used both as a per-row "
                             "array and as a table")
        if self.ctx.role == "when":
            raise self.unsupported(node, f"table read '{written}' in a guard (a guard is a "
                                         "function of the row: use a per-row array)")
        row = self.integer(self.expr(elts[0], env), elts[0])
        col = self.integer(self.expr(elts[1], env), elts[1])
        if row != self.ctx.symbols["i"]:
            raise self.unsupported(node, f"table read '{written}': a table's row is i "
                                         f"({name}[i, column])")
        if not col.has(self.ctx.symbols["j"]):
            raise self.unsupported(node, f"table read '{written}': its column must depend on j "
                                         "(a value of the row alone is a per-row array)")
        if any(is_table_read(f) for f in col.atoms(sp.core.function.AppliedUndef)):
            raise self.unsupported(node, f"table read '{written}': a column read from a table")
        self.ctx.table_params.add(name)
        return table_function(name)(row, col)

    def name(self, node, env):
        return self.lookup(node.id, env, node, allow_function=False)

    def lookup(self, name, env, node, allow_function):
        if name in env:
            return env[name]
        if name in self.fn.__code__.co_varnames:
            # assigned somewhere in the function, so local everywhere in it (Python raises
            # UnboundLocalError on this path rather than read a param or a global)
            raise ValueError(f"{self.where(node)}: {name!r} is assigned in the function but "
                             "read before any assignment on this path (Python would raise "
                             "UnboundLocalError); assign it on every path first")
        if name in self.ctx.params:
            if not allow_function:
                if name in self.ctx.array_params:
                    raise ValueError(f"{self.where(node)}: param {name!r} is a per-row array: "
                                     f"write {name}[i]")
                if name in self.ctx.table_params:
                    raise ValueError(f"{self.where(node)}: param {name!r} is a table: write "
                                     f"{name}[i, column]")
                self.ctx.scalar_params.add(name)
                return self.ctx.symbols[name]
        if name in ("seqlen_q", "seqlen_k"):
            if name in self.closure or name in self.fn.__globals__:
                raise ValueError(f"{self.where(node)}: {name!r} is the sequence length in a rule, "
                                 f"and a variable of that name is in scope (Python would read "
                                 "it); rename the variable")
            return self.ctx.symbols[name]
        if name in self.closure:
            value = self.closure[name]
        elif name in self.fn.__globals__:
            value = self.fn.__globals__[name]
        elif hasattr(builtins, name):
            value = getattr(builtins, name)
        elif name == HEAD_INDEX:
            raise HeadIndexRead(f"{self.where(node)}: reads the head index {HEAD_INDEX!r}")
        else:
            raise ValueError(
                f"{self.where(node)}: name {name!r} is not a declared param, an int constant or "
                "a helper function"
            )
        if isinstance(value, bool):
            return sp.true if value else sp.false
        if isinstance(value, int):
            return sp.Integer(value)
        if allow_function and (
            isinstance(value, types.FunctionType) or value in (builtins.min, builtins.max, abs)
        ):
            return value
        if allow_function and callable(value):
            raise self.unsupported(node, f"call to '{name}' (not min/max/abs or a plain function)")
        raise ValueError(
            f"{self.where(node)}: name {name!r} is bound to {type(value).__name__}, not an int "
            "constant, a declared param or a helper function"
        )


def _who(ctx: RuleContext, fn, depth: int) -> str:
    base = f"Region {ctx.region!r}, {ctx.role} function"
    return f"{base} {fn.__name__!r}" if depth == 0 else f"{base} helper {fn.__name__!r}"


def inline_function(fn, args, ctx: RuleContext, depth: int, call_node=None, caller=None,
                    found=None):
    """``fn`` applied to the expressions ``args`` (tensors when the rule runs on tensors)."""
    return _inline(fn, args, [True] * len(args), ctx, depth, call_node, caller, found)[0]


def _inline(fn, args, tensors, ctx: RuleContext, depth: int, call_node=None, caller=None,
            found=None):
    """``fn`` applied to ``args``: its expression, and whether every value it returns is a
    tensor given which of ``args`` are (``tensors``)."""
    node, _, filename = found or _func_source_node(fn, _who(ctx, fn, depth))
    tr = _Translator(ctx, fn, filename, depth)
    a = node.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.defaults or a.posonlyargs:
        raise tr.unsupported(node, "signature (only plain positional arguments)")
    if len(a.args) != len(args):
        where = caller.where(call_node) if caller else tr.where(node)
        raise TypeError(f"{where}: {fn.__name__} takes {len(a.args)} arguments, got {len(args)}")
    env: dict = {}
    for arg, v, tensor in zip(a.args, args, tensors):
        _bind(env, arg.arg, v, tensor)
    if isinstance(node, ast.Lambda):
        return tr.expr(node.body, env), tr.tensor[id(node.body)]
    out = tr.block(list(node.body), env, node)
    return out, tr.returns_tensor


def translate_rule(fn, ctx: RuleContext) -> TranslatedRule:
    """Pass 1: translate ``when(i)`` or ``visible(i, j)`` into a sympy Boolean."""
    found = _func_source_node(fn, _who(ctx, fn, 0))
    src = found[1]
    args = [ctx.symbols["i"]] if ctx.role == "when" else [ctx.symbols["i"], ctx.symbols["j"]]
    expr = _truth(inline_function(fn, args, ctx, 0, found=found))
    if not _is_bool(expr):
        raise TypeError(
            f"Region {ctx.region!r}, {ctx.role} function {fn.__name__!r}: must return a boolean "
            f"(a comparison), got the integer expression {expr}"
        )
    return TranslatedRule(expr=expr, source=textwrap.dedent(src), func_name=fn.__name__)
