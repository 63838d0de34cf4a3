"""Generated torch reference preprocess: a compiled mask's regions -> the source of
``interval_table`` (the Interval Table of any rows) and ``predicate_<region>`` (a fallback
region's element predicate), run on any device by ``compilemask.pipeline``'s torch path and
the brute-force checks."""

from __future__ import annotations

import sympy as sp

from compilemask.contract.lru import register_source
from compilemask.dsl.exprprint import TORCH_PRELUDE, TorchPrinter

__all__ = ["torch_source", "exec_source"]


def exec_source(source: str, filename: str) -> dict:
    """exec generated code under a linecache entry, so tracebacks show the generated lines."""
    register_source(filename, source)
    ns: dict = {}
    exec(compile(source, filename, "exec"), ns)
    return ns


def torch_source(name, key, regions, scalar, arrays, K, tables=()) -> str:
    # params are spelled p_<name> / a_<name>_i|j, so that no param can shadow a name of the
    # generated code (region, guard, lo, torch...); the lengths are read as 0-d tensors, so that
    # a condition on them alone is a tensor too (~ on a Python bool is an int)
    pr = TorchPrinter({"seqlen_q": "sq", "seqlen_k": "sk", **{p: f"p_{p}" for p in scalar}},
                      array_prefix="a_")
    args = (["i", "seqlen_q", "seqlen_k"] + [f"p_{p}" for p in scalar]
            + [f"a_{a}_i" for a in arrays])
    out = [f"# Reference preprocess for mask {name!r} (canonical hash {key}), generated.",
           TORCH_PRELUDE,
           f"NUM_INTERVALS = {K}", "", "",
           f"def interval_table({', '.join(args)}, *, batch_size):",
           '    """Rows: i int64 [1, Sq]; scalar params int64 [B, 1]; arrays int64 [B, Sq].',
           '    Returns starts, lens (int64 [B, Sq, K], clipped to [0, seqlen_k)) and the row\'s',
           '    region (int64 [B, Sq], -1: none): the first region whose guard holds."""',
           "    shape = (batch_size, i.shape[-1])",
           "    dev = i.device",
           # made on the rows' device (a fill, not a host copy: CUDA-graph capturable)
           "    sq, sk = _on(seqlen_q, dev), _on(seqlen_k, dev)",
           "    _TRUE, _FALSE = _on(True, dev), _on(False, dev)",
           f"    lo = torch.zeros(shape + ({K},), dtype=torch.int64, device=dev)",
           "    hi = torch.zeros_like(lo)",
           "    region = torch.full(shape, -1, dtype=torch.int64, device=dev)"]
    for r in regions:
        out.append("")
        out.append(f"    # region {r.index} {r.name!r}: rows where {r.guard}")
        out.append(f"    guard = torch.broadcast_to(_on({pr(r.guard)}, dev), shape)")
        out.append("    take = guard & (region < 0)")
        out.append(f"    region = torch.where(take, {r.index}, region)")
        for k, iv in enumerate(r.intervals):
            tag = "" if iv.exact else "  (over-approximation: fallback)"
            out.append(f"    # slot {k}: [{iv.lower}, {iv.upper})"
                       + (f" if {iv.cond}" if iv.cond is not sp.true else "") + tag)
            ok = "take" if iv.cond is sp.true else f"take & {pr(iv.cond)}"
            out.append(f"    ok = torch.broadcast_to({ok}, shape)")
            out.append(f"    lo[..., {k}] = torch.where(ok, {pr(iv.lower)}, lo[..., {k}])")
            out.append(f"    hi[..., {k}] = torch.where(ok, {pr(iv.upper)}, hi[..., {k}])")
    out += ["",
            "    # clip to the keys that exist; empty slots are (0, 0)",
            "    starts = torch.clamp(lo, 0, seqlen_k)",
            "    lens = torch.clamp(torch.clamp(hi, 0, seqlen_k) - starts, min=0)",
            "    starts = torch.where(lens > 0, starts, 0)",
            "    return starts, lens, region", ""]
    # Element predicates of fallback regions (the residual check), on [B, Sq, Sk] grids.
    fb_args = ["i", "j", "seqlen_q", "seqlen_k"] + [f"p_{p}" for p in scalar] + [
        f"a_{a}_{x}" for a in arrays for x in "ij"] + [f"a_{t}_t" for t in tables]
    for r in regions:
        if r.fallback:
            out += ["", f"def predicate_{r.index}({', '.join(fb_args)}):",
                    f'    """Region {r.name!r}: {r.rule}"""',
                    "    sq, sk = _on(seqlen_q, i.device), _on(seqlen_k, i.device)",
                    "    _TRUE, _FALSE = _on(True, i.device), _on(False, i.device)",
                    f"    return {pr(r.rule)}", ""]
    return "\n".join(out)
