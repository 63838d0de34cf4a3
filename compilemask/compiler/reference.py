"""Reference paths: the dense mask a descriptor encodes, the brute-force oracle that calls the
user's Python rules, and dense masked attention (the CPU path of ``cm.attention``)."""

from __future__ import annotations

import dis
import functools
import operator
import os
import types

import torch

from compilemask.contract.descriptor import in_interval, unpack_table
from compilemask.contract.log import warn_gpu_refusal
from compilemask.dsl.score_mod import gpu_refusal

__all__ = ["descriptor_dense_mask", "brute_force_mask", "attention_reference"]


def descriptor_dense_mask(desc, heads: int = 1) -> torch.Tensor:
    """bool [B, Sq, Sk] from the Interval Table (and fallback predicates), as a kernel sees it;
    ``heads > 1``: a descriptor of a sequence per (batch, head) as ``[B, heads, Sq, Sk]``."""
    mask = desc.mask
    iv = desc.intervals.to(torch.int64)
    starts, lens = iv[..., 0], iv[..., 1]
    j = torch.arange(desc.seqlen_k, device=iv.device, dtype=torch.int64)
    # uint32(j - start) < uint32(len), over the K slots
    dense = torch.zeros(desc.batch_size, desc.seqlen_q, desc.seqlen_k, dtype=torch.bool,
                        device=iv.device)
    for k in range(desc.num_intervals):
        dense |= in_interval(j, starts[:, :, k : k + 1], lens[:, :, k : k + 1])
    for r in mask.fallback_regions:
        rows = desc.row_region == r.index  # [B, Sq]
        pred = evaluate_predicate(desc, r.index)
        dense = torch.where(rows.unsqueeze(-1), dense & pred, dense)
    return dense.view(-1, heads, *dense.shape[1:]) if heads > 1 else dense


def evaluate_predicate(desc, region_index: int, batch: int | None = None, rows=None,
                       cols=None) -> torch.Tensor:
    """The residual predicate of a fallback region on the ``[B, Sq, Sk]`` grid, or of one
    sequence ``batch`` on rows ``[r0, r1)`` x keys ``[c0, c1)`` (``[1, r1 - r0, c1 - c0]``)."""
    mask = desc.mask
    B, Sq, Sk = desc.batch_size, desc.seqlen_q, desc.seqlen_k
    r0, r1 = rows or (0, Sq)
    c0, c1 = cols or (0, Sk)
    seqs = slice(None) if batch is None else slice(batch, batch + 1)
    nb = B if batch is None else 1
    dev = desc.intervals.device
    j = torch.arange(c0, c1, device=dev, dtype=torch.int64).view(1, 1, -1)
    params = desc.params[seqs].to(torch.int64)
    row_params = desc.row_params[seqs]
    if desc.positions is not None:  # chosen rows: i is the row's position, keys by position
        i = desc.positions[seqs, r0:r1].to(torch.int64).view(nb, -1, 1)
        # the rules' seqlen_q / seqlen_k are the whole sequence's (both Sk)
        args = [i, j, Sk, Sk] + [params[:, k].view(nb, 1, 1)
                                 for k in range(len(mask.scalar_params))]
        keys = desc.key_params[seqs]
        for k in range(len(mask.array_params)):
            args += [row_params[:, r0:r1, k].to(torch.int64).view(nb, -1, 1),
                     keys[:, c0:c1, k].to(torch.int64).view(nb, 1, -1)]
    else:
        i = torch.arange(r0, r1, device=dev, dtype=torch.int64).view(1, -1, 1)
        args = [i, j, Sq, Sk] + [params[:, k].view(nb, 1, 1)
                                 for k in range(len(mask.scalar_params))]
        for k in range(len(mask.array_params)):
            arr = row_params[..., k].to(torch.int64)
            if Sk > Sq:
                # only arrays read at i reach here (preprocess refuses reads at j when Sk > Sq):
                # the padded key view keeps the generated signature and is never read
                arr_j = torch.nn.functional.pad(arr, (0, Sk - Sq))
            else:
                arr_j = arr[:, :Sk]
            args += [arr[:, r0:r1].view(nb, -1, 1), arr_j[:, c0:c1].view(nb, 1, -1)]
    if mask.table_params:  # one table: its words follow the arrays (at the rows)
        args.append(unpack_table(row_params[:, r0:r1, len(mask.array_params):]))
    fn = mask.torch_function(f"predicate_{region_index}")
    return torch.broadcast_to(fn(*args), (nb, r1 - r0, c1 - c0))


def _rebind(fn, env: dict, memo: dict):
    """A copy of ``fn`` whose free names (globals and closure cells) see ``env`` first; helper
    functions it calls are rebound the same way."""
    if fn in memo:
        return memo[fn] or fn  # None: a recursive helper, being rebound
    memo[fn] = None
    g = dict(fn.__globals__)
    for name in fn.__code__.co_names:
        if name in env:
            g[name] = env[name]
        elif isinstance(g.get(name), types.FunctionType):
            g[name] = _rebind(g[name], env, memo)
    cells = None
    if fn.__closure__:
        cells = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
            if name in env:  # a param, even where the cell is still unbound
                cells.append(types.CellType(env[name]))
                continue
            try:
                val = cell.cell_contents
            except ValueError:
                cells.append(cell)
                continue
            if isinstance(val, types.FunctionType):
                val = _rebind(val, env, memo)
            cells.append(types.CellType(val))
        cells = tuple(cells)
    copy = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, cells)
    memo[fn] = copy
    return copy


_INVERT = dis.opmap["UNARY_INVERT"]


def _uses_invert(fn, seen: set) -> bool:
    """Whether ``fn`` or a function it can reach applies ``~`` (a scan of the bytecode)."""
    if not isinstance(fn, types.FunctionType) or fn in seen:
        return False
    seen.add(fn)
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        if any(ins.opcode == _INVERT for ins in dis.get_instructions(code)):
            return True
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            pass
    reach = [fn.__globals__.get(n) for n in fn.__code__.co_names] + cells
    return any(_uses_invert(g, seen) for g in reach)


def _raw(x):
    return x.t if isinstance(x, _Value) else x


class _Value:
    """A 0-d tensor as a rule called on tensors sees it: every operation is torch's, on the
    tensor inside, and gives a new value. Without in-place operators, ``x += 1`` on a local that
    shares its value with a param, ``i`` or another local (``x = w``, ``x = max(i, 5)``,
    ``y = x``) rebinds the local, as on Python ints, and never writes into the shared tensor."""

    __slots__ = ("t",)
    __hash__ = None

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __bool__(self):
        return bool(self.t)

    def __int__(self):
        return int(self.t)

    def __index__(self):
        return self.t.__index__()

    def __repr__(self):
        return f"_Value({self.t.item()!r})"


def _forward(op):
    return lambda self, other: _Value(op(self.t, _raw(other)))


def _reflected(op):
    return lambda self, other: _Value(op(_raw(other), self.t))


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv),
                   ("mod", operator.mod), ("pow", operator.pow), ("and", operator.and_),
                   ("or", operator.or_), ("xor", operator.xor), ("lshift", operator.lshift),
                   ("rshift", operator.rshift)):
    setattr(_Value, f"__{_name}__", _forward(_op))
    setattr(_Value, f"__r{_name}__", _reflected(_op))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(_Value, f"__{_name}__", _forward(getattr(operator, _name)))
for _name, _op in (("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs),
                   ("invert", operator.invert)):
    setattr(_Value, f"__{_name}__", lambda self, op=_op: _Value(op(self.t)))


def _value(v, dtype=torch.int64) -> _Value:
    return _Value(torch.tensor(v, dtype=dtype))


class _TableRows:
    """A table param as the rules read it: ``t[i, c]`` is whether row ``i``'s entry ``c`` is
    set, False at columns outside the table; a 0-d bool tensor where the rules run on tensors
    (``~t[i, c]`` is then not, as on the bool tensor a table is)."""

    def __init__(self, entries: torch.Tensor, tensors: bool):
        self.rows = [[bool(x) for x in row] for row in entries.tolist()]
        self.tensors = tensors

    def __getitem__(self, rc):
        i, c = (int(x) for x in rc)
        row = self.rows[i]
        got = 0 <= c < len(row) and row[c]
        return _value(got, torch.bool) if self.tensors else got


def brute_force_mask(mask, B, scal, arrs, seqlen_q, seqlen_k) -> torch.Tensor:
    """Call the user's rules on every (i, j): a row belongs to the first region whose guard
    holds, and sees the keys its rule accepts. Slow by design; it is the oracle.

    A rule may negate a comparison with ``~`` (logical not, as on torch bool tensors); on a
    Python bool ``~`` is bitwise (``~True == -2``), so such rules are called on 0-d int64
    tensors instead of ints, where ``~`` of a comparison is the logical not. Nothing writes
    into those tensors (``_Value``), so every call sees the values Python ints would have."""
    spec = mask.spec
    seen: set = set()
    tensors = any(_uses_invert(f, seen) for r in spec.regions for f in (r.when, r.visible))
    num = _value if tensors else int
    out = torch.zeros(B, seqlen_q, seqlen_k, dtype=torch.bool)
    for b in range(B):
        env = {p: num(int(scal[p][b, 0])) for p in scal}
        env.update({a: [num(x) for x in arrs[a][b].tolist()] for a in arrs
                    if a not in mask.table_params})
        env.update({t: _TableRows(arrs[t][b], tensors) for t in mask.table_params})
        env["seqlen_q"], env["seqlen_k"] = num(seqlen_q), num(seqlen_k)
        memo: dict = {}
        regions = [(_rebind(r.when, env, memo), _rebind(r.visible, env, memo))
                   for r in spec.regions]
        rows = out[b]
        for i in range(seqlen_q):
            for when, visible in regions:
                if when(num(i)):
                    rows[i] = torch.tensor([bool(visible(num(i), num(j)))
                                            for j in range(seqlen_k)])
                    break
    return out


def apply_score_mod(s, score_mod):
    """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` on scaled scores ``s`` [B, H,
    Sq, Sk], as Flex calls it: per score. A score_mod the GPU converter compiles is elementwise
    by construction (every operation it reads is), so it is called once with index tensors
    broadcast along their own axis (int64): the fast path, exact. Any other score_mod
    (``torch.dot`` of rows read at q_idx and kv_idx, a reduction, a function the converter does
    not read) is called per score through ``torch.vmap`` over the four indices, as Flex's own
    ``_vmap_for_bhqkv`` does, and said once (``GpuRefusalWarning``): the GPU engines refuse it."""
    B, H, Sq, Sk = s.shape
    dev = s.device
    why = gpu_refusal(score_mod)
    if why is None:
        idx = [torch.arange(n, device=dev).view(shape) for n, shape in (
            (B, (B, 1, 1, 1)), (H, (1, H, 1, 1)), (Sq, (1, 1, Sq, 1)), (Sk, (1, 1, 1, Sk)))]
        out = score_mod(s, *idx)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"score_mod must return a tensor, got {type(out).__name__}")
        return torch.broadcast_to(out.to(s.dtype), s.shape)
    fn = _checked_output(score_mod)
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None),
                 (0, None, None, None)):  # kv_idx innermost, as Flex maps them
        fn = torch.vmap(fn, in_dims=(0, *dims), out_dims=0)
    idx = [torch.arange(n, device=dev) for n in (B, H, Sq, Sk)]
    try:
        out = fn(s, *idx)
    except RuntimeError as e:
        if "data-dependent control flow" not in str(e):
            raise
        raise RuntimeError(
            f"score_mod {getattr(score_mod, '__name__', 'score_mod')!r} "
            f"({_user_frame(e.__traceback__)}): data-dependent Python control flow on a tensor "
            "('if', 'and', 'or', 'not', min/max builtins of score, q_idx, kv_idx ...), which "
            "FlexAttention cannot call either; use torch.where(cond, a, b), & | ~") from None
    _warn_refused(score_mod, why)
    return out.to(s.dtype)


def _checked_output(score_mod):
    def call(score, b, h, q_idx, kv_idx):
        out = score_mod(score, b, h, q_idx, kv_idx)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"score_mod must return a tensor, got {type(out).__name__}")
        if out.dim() != 0:
            raise ValueError(f"score_mod {getattr(score_mod, '__name__', 'score_mod')!r} "
                             f"returned shape {list(out.shape)} for one score (a score_mod "
                             "returns one value per score)")
        return out
    return call


def _user_frame(tb) -> str:
    """file:line of the innermost traceback frame outside torch and this package."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    where = "?"
    while tb is not None:
        fn = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not fn.startswith(skip):
            where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _warn_refused(score_mod, why: str) -> None:
    """One ``GpuRefusalWarning`` per score_mod function (its code)."""
    fn = score_mod
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    warn_gpu_refusal(code if code is not None else id(fn),
                     f"the reference engine runs this score_mod, which the GPU engines refuse "
                     f"({why})", stacklevel=5)


def attention_reference(q, k, v, dense_mask, softmax_scale=None, return_lse=False,
                        score_mod=None, learnable_sink=None):
    """Dense masked attention in float32: q [B, Sq, H, D], k/v [B, Sk, Hkv, D], mask [B, Sq, Sk];
    ``score_mod`` (FlexAttention's) applied to the scaled scores before the mask;
    ``learnable_sink`` [H]: a per-head logit in every row's softmax that no value goes with
    (gpt-oss's sinks, FA4's ``learnable_sink``). A ``[B, H, Sq, Sk]`` mask is one per head.

    Rows that see nothing give O = 0 and LSE = -inf (never NaN); differentiable."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(acc).transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    if Hkv != H:
        kf = kf.repeat_interleave(H // Hkv, dim=1)
        vf = vf.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if score_mod is not None:
        s = apply_score_mod(s, score_mod)
    m = dense_mask.to(s.device)
    m = m if m.dim() == 4 else m.unsqueeze(1)  # [B, H, Sq, Sk]: a mask per head
    s = s.masked_fill(~m, float("-inf"))
    # keys no row sees may be memory the call does not own (a served buffer's tail): a zero
    # weight times a NaN there would still be NaN
    vf = torch.where(m.any(dim=-2).unsqueeze(-1), vf, torch.zeros((), dtype=acc))
    row_max = s.amax(dim=-1, keepdim=True)
    if learnable_sink is not None:
        if learnable_sink.shape != (H,):
            raise ValueError(f"learnable_sink must be [H] = [{H}], got "
                             f"{list(learnable_sink.shape)}")
        sink = learnable_sink.to(acc).view(1, H, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max).detach()
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    if learnable_sink is not None:
        denom = denom + torch.exp(sink - row_max)
    o = torch.matmul(p, vf) / torch.where(denom == 0, torch.ones_like(denom), denom)
    o = o.transpose(1, 2).to(q.dtype)
    if not return_lse:
        return o
    lse = (row_max + torch.log(denom)).squeeze(-1)  # [B, H, Sq]; -inf where denom == 0
    return o, lse
