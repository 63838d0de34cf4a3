"""Generated TileLang program: a batch's column table (``compiler.columns``) in one launch.

Grid ``(ceil(S / THREADS), B)``, a thread per key. A key evaluates the column view's N
intervals of query rows (the compiled endpoints, in int64, as the preprocess evaluates a row's),
clips them to ``[0, S)``, sorts them by start (an N-element bubble sort in registers), sweeps
them into the runs of their union (an interval that starts at or before the current run's end
extends it) and writes the first ``SLOTS`` runs, or ``(0, OVERFLOW)`` in slot 0 when there are
more. It reads the metadata copies the descriptor carries (``params``, ``row_params``, int32),
so it runs after the preprocess on its outputs. Bit-identical to ``columns.column_table`` (the
torch reference), which a CPU test checks on TileLang's C target.

The batch size and the length are dynamic: a new length never recompiles.
"""

from __future__ import annotations

import sympy as sp
import torch

from compilemask.compiler.columns import OVERFLOW
from compilemask.contract.cache import CompileCache

from .tilelang_build import Program, ProgramEmitter, check_target, compile_program, raw_launch
from .tl_printer import TileLangPrinter

__all__ = ["column_table_source", "column_table_program", "tilelang_column_table"]

THREADS = 256


class _Emitter(ProgramEmitter):
    def __init__(self, mask, target: str):
        super().__init__(target)
        self.mask, self.view = mask, mask.column_view
        names = {"i": "i", "seqlen_q": "sq", "seqlen_k": "sk"}
        for n, p in enumerate(mask.scalar_params):
            names[p] = f'T.Cast("int64", params[b, {n}])'
        arrays = {a: f'T.Cast("int64", row_params[b, row, {n}])'
                  for n, a in enumerate(mask.array_params)}
        self.pr = TileLangPrinter(names, arrays)

    def source(self) -> str:
        m, v, w = self.mask, self.view, self.w
        N = max(v.num_intervals, 1)
        P, R = len(m.scalar_params), len(m.array_params)
        w(0, f"# TileLang column table for mask {m.name!r} (canonical hash {m.key}), generated "
             "by compilemask.codegen.")
        w(0, f"# Target: {self.target}. Per key: the rows that see it, {N} intervals, merged "
             f"into at most {v.slots} runs:")
        for k, iv in enumerate(v.region.intervals):
            cond = "" if iv.cond is sp.true else f"  if {iv.cond}"
            w(0, f"#   interval {k}: rows [{iv.lower}, {iv.upper}){cond}  (i: the key)")
        w(0, "import tilelang.language as T")
        w(0)
        w(0, f"N = {N}  # intervals per key")
        w(0, f"SLOTS = {v.slots}  # runs kept per key")
        w(0, f"THREADS = {THREADS}")
        w(0, "EMPTY = 2147483647  # sort key of an empty interval (sorts last)")
        w(0, f"OVERFLOW = {OVERFLOW}  # slot 0's length when a key has more runs than SLOTS")
        w(0)
        w(0, 'B = T.dynamic("B")  # batch size')
        w(0, 'S = T.dynamic("S")  # keys (= query rows: square attention)')
        w(0)
        w(0)
        w(0, "@T.prim_func")
        w(0, "def column_table(")
        if P:
            w(1, f'params: T.Tensor((B, {P}), "int32"),  # the descriptor\'s scalar params')
        if R:
            w(1, f'row_params: T.Tensor((B, S, {R}), "int32"),  # its per-row arrays')
        w(1, 'columns: T.Tensor((B, S, SLOTS, 2), "int32"),  # out: per key (start, len) runs')
        w(0, "):")
        threads = ", threads=THREADS" if self.cuda else ""
        w(1, f"with T.Kernel(T.ceildiv(S, THREADS), B{threads}) as (bx, b):")
        ind = 2
        if self.cuda:
            w(ind, "tx = T.get_thread_binding()")
        for name, shape, dtype, what in (("lo", "N", "int64", "interval ends before the clip"),
                                         ("hi", "N", "int64", None),
                                         ("ss", "N", "int32", "clipped, sorted by start"),
                                         ("ee", "N", "int32", None),
                                         ("out", "2 * SLOTS", "int32", "the key's table row")):
            w(ind, f'{name} = T.alloc_local(({shape},), "{dtype}")'
              + (f"  # {what}" if what else ""))
        for name, dtype in (("i", "int64"), ("sq", "int64"), ("sk", "int64"), ("cs", "int32"),
                            ("ce", "int32"), ("runs", "int32"), ("tmp", "int32")):
            w(ind, f'{name} = T.alloc_var("{dtype}")')
        self.stage(ind, "per key: intervals, clip, sort, runs, table row", self._key, sync=False)
        return "\n".join(self.lines) + "\n"

    def _key(self, ind):
        w, pr, v = self.w, self.pr, self.view
        N = max(v.num_intervals, 1)
        w(ind, "row = bx * THREADS + tx  # the key: the view's row")
        w(ind, "if row < S:")
        ind += 1
        w(ind, 'i = T.Cast("int64", row)')
        w(ind, 'sq = T.Cast("int64", S)')
        w(ind, "sk = sq")
        w(ind, "for k in T.unroll(N):")
        w(ind + 1, "lo[k] = 0")
        w(ind + 1, "hi[k] = 0")
        for k, iv in enumerate(v.region.intervals):
            d = ind
            if iv.cond is not sp.true:
                w(d, f"if {pr(iv.cond)}:")
                d += 1
            w(d, f"lo[{k}] = {pr(iv.lower)}")
            w(d, f"hi[{k}] = {pr(iv.upper)}")
        w(ind, "# clip to the rows that exist; empty intervals sort last")
        w(ind, "for k in T.unroll(N):")
        w(ind + 1, "ss[k] = T.Cast(\"int32\", T.min(T.max(lo[k], 0), sk))")
        w(ind + 1, "ee[k] = T.Cast(\"int32\", T.min(T.max(hi[k], 0), sk))")
        w(ind + 1, "if ee[k] <= ss[k]:")
        w(ind + 2, "ss[k] = EMPTY")
        w(ind + 2, "ee[k] = EMPTY")
        if N > 1:
            self.sort_by_first(ind, "N", "ss", "ee")
        w(ind, "for k in T.unroll(2 * SLOTS):")
        w(ind + 1, "out[k] = 0")
        w(ind, "runs = 0")
        self.sweep_runs(ind, "N", N, "ss", "ee", self._run)
        w(ind, "if runs > SLOTS:")
        w(ind + 1, "for k in T.unroll(2 * SLOTS):")
        w(ind + 2, "out[k] = T.if_then_else(k == 1, OVERFLOW, 0)")
        w(ind, "for k in T.unroll(2 * SLOTS):")
        w(ind + 1, "columns[b, row, k // 2, k % 2] = out[k]")

    def _run(self, ind):
        """Close the run [cs, ce): into slot ``runs`` while one is free (static indices)."""
        w = self.w
        w(ind, "for s in T.unroll(SLOTS):")
        w(ind + 1, "if runs == s:")
        w(ind + 2, "out[2 * s] = cs")
        w(ind + 2, "out[2 * s + 1] = ce - cs")
        w(ind, "runs = runs + 1")


def column_table_source(mask, target: str = "cuda") -> str:
    """The generated program (module text defining ``column_table``) for ``mask``'s view."""
    check_target(target)
    if mask.column_view is None:
        raise ValueError(f"mask {mask.name!r} has no column view ({mask.column_view_reason})")
    return _Emitter(mask, target).source()


def column_table_program(mask, target: str) -> Program:
    """What :func:`tilelang_column_table` compiles, as a ``tilelang_build.Program``."""
    return Program(column_table_source(mask, target), f"{target}_{mask.key}_columns",
                   "column_table", target, f"the column table program of mask {mask.name!r}")


# TileLang compiles run one at a time (its compiler is not known to be thread-safe)
_KERNELS = CompileCache("tilelang_column_table", serial=True)


def _launcher(mask, device_type: str):
    target = "cuda" if device_type == "cuda" else "c"

    def build():
        kern = compile_program(*column_table_program(mask, target))
        return raw_launch(kern) if target == "cuda" else kern

    return _KERNELS.get((mask.key, target), build)


def tilelang_column_table(mask, params: torch.Tensor, row_params: torch.Tensor,
                          seqlen: int) -> torch.Tensor:
    """int32 ``[B, S, slots, 2]`` from a descriptor's ``params [B, P]`` and ``row_params [B, S,
    R]`` (the mask's arrays first), on their device (CUDA, or the C target on CPU). No host
    sync."""
    B, dev = params.shape[0], params.device
    out = torch.empty(B, seqlen, mask.column_view.slots, 2, dtype=torch.int32, device=dev)
    args = []
    if mask.scalar_params:
        args.append(params.contiguous())
    if mask.array_params:
        args.append(row_params[..., :len(mask.array_params)].contiguous())
    _launcher(mask, dev.type)(*args, out)
    return out
