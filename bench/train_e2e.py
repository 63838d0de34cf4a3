"""End-to-end training benchmark: a Qwen3-shaped transformers model, one attention function each.

    python bench/train_e2e.py --masks hstu,causal --seqlens 32768 --out $OUT --tag e2e
    python bench/train_e2e.py --merge a.json b.json --tag merged     # no GPU needed
    python bench/train_e2e.py --smoke                                 # tiny model on the CPU

What is measured. A ``Qwen3ForCausalLM`` built from a config (the 8B shape with ``--layers``
layers, random init from ``--seed``, bf16 weights), AdamW (foreach), non-reentrant activation
checkpointing and ``torch.compile`` of each decoder layer (``--compile-scope model``: the
whole model), trains on one sequence of S random tokens per
step. The attention function is the only difference between backends: each is registered with
``transformers.AttentionInterface`` and gets what it needs per step through the model's keyword
arguments:

* ``compilemask``: ``compilemask.integrations.transformers``; the descriptor is built once per
  step (a bound ``mask.preprocessor``) and reused by every layer and by the recomputation;
* ``flex_fa4``: ``flex_attention(..., kernel_options={"BACKEND": "FLASH"})`` with a BlockMask
  from ``create_block_mask`` once per step, over the mask module's ``flex_mask_mod``;
* ``fa4_native``: FA4's own causal / varlen kernels (causal and docs only);
* ``sdpa``: dense boolean mask, prebuilt (by default only up to 8K tokens).

Per (mask, S, backend): the median and mean step time (CUDA events around each whole step:
mask build, forward, backward, optimizer), tokens/s, the peak allocated memory, the mask build
(preprocess / create_block_mask) time per step, measured with events around it inside the step,
and the attention's share of the step: ``torch.profiler`` over two more steps, the CUDA time of
the kernels whose names match ``ATTN_RULE`` over all kernel time. The first ten losses of every
backend (same seed, data and init) are compared with the compilemask and sdpa ones.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

import compilemask as cm  # noqa: E402
from bench.engines import SPECS, _cbm, _flex, doc_meta, workload_mask_mod  # noqa: E402
from bench.workloads import make_meta  # noqa: E402
from compilemask import masks
from compilemask.dsl import packing  # noqa: E402

MASKS = ("hstu", "hstu_packed", "shared_prompt_rm", "clear", "causal", "docs")
BACKENDS = ("compilemask", "flex_fa4", "fa4_native", "sdpa")
SDPA_DEFAULT_MAX = 8192  # the dense [S, S] mask and SDPA's masked kernel beyond are a sideshow
N_LOSSES = 10
REL_TOL = 1e-2  # bf16 noise on a loss of ~12 (log of the vocabulary)
SHAPE_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936, rope_theta=1e6)
SHAPE_SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=128, rope_theta=1e6)
# attention kernels by name: FA4 / our CuTe kernels (Flash*, incl. the backward's pre- and
# postprocess), flex's Triton templates, SDPA's fused kernels, and the TileLang descriptor
# (preprocess) and tile-list (block_sparse) kernels; create_block_mask's kernels are generic
# inductor kernels, so the mask build is reported by its own events instead
ATTN_RULE = (r"flash|fmha|flex_attention|attention|efficient_attention|"
             r"^preprocess|block_sparse|compilemask")


# ---------------------------------------------------------------------------------------------
# masks: metadata, our spec, the flex mask_mod, and what each backend needs per step


def _lengths(S: int, gen: torch.Generator, median=2048, sigma=0.9, lo=256, hi=8192):
    """Long-tailed packed lengths (lognormal, clipped to [lo, hi]) filling S exactly; a short
    tail is merged into the last sequence. Below 32K the scale shrinks with S (the smoke's
    128 tokens still pack several users)."""
    f = min(1.0, S / 32768)
    median, lo, hi = max(8, int(median * f)), max(4, int(lo * f)), max(16, int(hi * f))
    out = []
    while sum(out) < S:
        n = torch.empty(1).log_normal_(math.log(median), sigma, generator=gen)
        out.append(int(min(max(float(n), lo), hi)))
    out[-1] -= sum(out) - S
    if len(out) > 1 and out[-1] < lo:
        out[-2] += out.pop()
    return out


def packed_hstu_host(S: int, seed: int = 0) -> dict:
    """Per-sequence HSTU metadata of packed users (CPU): lengths, and each user's context end
    (up to 10 %), history end (50-90 %) and group size (16-128)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(_lengths(S, g))
    frac = torch.rand(len(lens), generator=g)
    hist = (lens * (0.5 + 0.4 * frac)).long()
    ctx = (hist * 0.1 * torch.rand(len(lens), generator=g)).long()
    group = torch.tensor([16, 32, 64, 128])[torch.randint(0, 4, (len(lens),), generator=g)]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return {"cu_seqlens": cu, "hist_end": hist, "ctx_end": ctx, "group_size": group}


def packed_hstu_rows(host: dict, S: int, dev) -> dict:
    """The per-row arrays of ``packing.packed_hstu_spec``, on ``dev`` (torch ops, no sync)."""
    t = {k: v.to(dev, non_blocking=True) for k, v in host.items()}
    return packing.packed_hstu_meta(hist_end=t["hist_end"], group_size=t["group_size"],
                                    ctx_end=t["ctx_end"], cu_seqlens=t["cu_seqlens"], seqlen=S)


def packed_hstu_mask_mod(rows: dict, S: int):
    """``packed_hstu_spec`` as a flex mask_mod, with 1-D loads (what the FLASH backend takes)."""
    st, ce, he, se, gs = (rows[k].reshape(-1) for k in
                          ("seq_start", "ctx_end", "hist_end", "seq_end", "group_start"))

    def packed_hstu(b, h, q, kv):
        i = b * S + q
        s, c, hi, e, g = st[i], ce[i], he[i], se[i], gs[i]
        context = (q < c) & (kv >= s) & (kv < hi)
        history = (q >= c) & (q < hi) & (kv >= s) & (kv <= q)
        target = (q >= hi) & (q < e) & (((kv >= s) & (kv < hi)) | ((kv >= g) & (kv <= q)))
        return context | history | target
    return packed_hstu


class Workload:
    """One mask at one S: the fixed metadata (seeded) and per-step builders for each backend.
    ``rows()`` is the per-step metadata our preprocess and the flex mask_mod read."""

    def __init__(self, name: str, S: int, dev, seed: int = 0):
        self.name, self.S, self.dev = name, S, dev
        self.host = None
        if name == "hstu_packed":
            self.host = packed_hstu_host(S, seed)
            self.spec = packing.packed_hstu_spec()
        elif name == "docs":
            # documents of 512-8192 tokens; a short smoke sequence takes the module's few cuts
            self.host = doc_meta(1, S, seed) if S >= 4096 else masks.random_meta(
                SPECS["packed_documents"](), 1, S, torch.Generator().manual_seed(seed))
            self.spec = SPECS["packed_documents"]()
        else:
            self.spec = SPECS[name]()
            self.fixed = make_meta(name, 1, S, device=dev, seed=seed) if name != "causal" else {}
        self.mask = cm.compile_mask(self.spec)

    def rows(self) -> dict:
        if self.name == "hstu_packed":
            return packed_hstu_rows(self.host, self.S, self.dev)
        if self.name == "docs":
            return {"doc_start": self.host["doc_start"].to(self.dev, torch.int32)}
        return self.fixed

    def mask_mod(self, meta):
        if self.name == "hstu_packed":
            return packed_hstu_mask_mod(meta, self.S)
        return workload_mask_mod("packed_documents" if self.name == "docs" else self.name,
                                 meta, self.S)

    def segments(self):
        """(cu_seqlens int32 on the device, longest length) of the sequences or documents."""
        if self.name == "docs":
            ds = self.host["doc_start"][0]
            starts = torch.nonzero(ds == torch.arange(self.S)).flatten()
            cu = torch.cat([starts, torch.tensor([self.S])])
        else:
            cu = self.host["cu_seqlens"]
        return cu.to(self.dev, torch.int32), int((cu[1:] - cu[:-1]).max())

    def position_ids(self):
        """[1, S]: positions restart with each packed sequence (RoPE per sequence); None:
        0..S-1."""
        if self.host is None:
            return None
        cu, _ = self.segments()
        _, start, _ = packing.sequence_bounds(cu_seqlens=cu, seqlen=self.S)
        return torch.arange(self.S, device=self.dev) - start


# ---------------------------------------------------------------------------------------------
# attention functions (transformers' signature: q [B, H, S, D], k/v [B, Hkv, S, D] ->
# (out [B, S, H, D], None)); the per-step mask arrives as a keyword argument

FLEX_KW, FA4_KW, SDPA_KW = "flex_block_mask", "fa4_segments", "dense_mask"
_FLEX_STATE = {"compile_call": True, "kernel_options": {"BACKEND": "FLASH"}}


def flex_fa4_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       **kwargs):
    from torch.nn.attention.flex_attention import flex_attention

    # flex_attention must run compiled: inside a compiled model it is, else wrap it
    fn = _flex() if _FLEX_STATE["compile_call"] else flex_attention
    out = fn(query, key, value, block_mask=kwargs[FLEX_KW], enable_gqa=True, scale=scaling,
             kernel_options=_FLEX_STATE["kernel_options"])
    return out.transpose(1, 2), None


def sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   **kwargs):
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=kwargs[SDPA_KW], scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


@functools.lru_cache(maxsize=None)
def _fa4_ops():
    """FA4's public forward and its backward as custom ops, so the compiled model keeps one
    graph per layer (FA4's autograd function is not traceable); the calls are those of
    ``flash_attn_func`` / ``flash_attn_varlen_func`` and their autograd backward."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    from flash_attn.cute.interface import _flash_attn_bwd

    @torch.library.custom_op("cm_e2e::fa4_fwd", mutates_args=())
    def fa4_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor | None,
                max_len: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if cu is None:
            out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=True,
                                       return_lse=True)
            return out.contiguous(), lse.contiguous()  # the strides the fake promises
        B, S, H, D = q.shape
        out, lse = flash_attn_varlen_func(
            q.reshape(B * S, H, D), k.reshape(B * S, -1, D), v.reshape(B * S, -1, D),
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
            softmax_scale=scale, causal=True, return_lse=True)
        return out.view(B, S, H, D).contiguous(), lse.contiguous()  # lse [H, B*S]

    @fa4_fwd.register_fake
    def _(q, k, v, cu, max_len, scale):
        B, S, H, _ = q.shape
        shape = (B, H, S) if cu is None else (H, B * S)
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                q.new_empty(shape, dtype=torch.float32))

    @torch.library.custom_op("cm_e2e::fa4_bwd", mutates_args=())
    def fa4_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, cu: torch.Tensor | None, max_len: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if cu is None:
            dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale,
                                         causal=True)
            return dq.contiguous(), dk.contiguous(), dv.contiguous()
        B, S, H, D = q.shape
        flat = [t.reshape(B * S, t.shape[2], D) for t in (q, k, v, out, dout)]
        dq, dk, dv = _flash_attn_bwd(*flat, lse, scale, causal=True, cu_seqlens_q=cu,
                                     cu_seqlens_k=cu, max_seqlen_q=max_len,
                                     max_seqlen_k=max_len)
        return (dq.view(q.shape).contiguous(), dk.view(k.shape).contiguous(),
                dv.view(v.shape).contiguous())

    @fa4_bwd.register_fake
    def _(dout, q, k, v, out, lse, cu, max_len, scale):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                     for t in (q, k, v))

    def setup(ctx, inputs, output):
        q, k, v, cu, max_len, scale = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], cu)
        ctx.max_len, ctx.scale = max_len, scale

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = fa4_bwd(dout, q, k, v, out, lse, cu, ctx.max_len, ctx.scale)
        return dq, dk, dv, None, None, None

    fa4_fwd.register_autograd(backward, setup_context=setup)
    return fa4_fwd


def fa4_native_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         **kwargs):
    cu, max_len = kwargs[FA4_KW] or (None, 0)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views
    out, _ = _fa4_ops()(q, k, v, cu, max_len, float(scale))
    return out, None


def register_all() -> dict:
    """Every backend's ``attn_implementation`` name."""
    from transformers import AttentionInterface

    from compilemask.integrations.transformers import register

    names = {"compilemask": register()}
    for name, fn in (("flex_fa4", flex_fa4_attention), ("fa4_native", fa4_native_attention),
                     ("sdpa", sdpa_attention)):
        AttentionInterface.register(f"e2e_{name}", fn)
        names[name] = f"e2e_{name}"
    return names


def step_builder(backend: str, wl: Workload):
    """A function that builds this step's mask keyword arguments, or the reason it cannot run."""
    dev, S = wl.dev, wl.S
    if backend == "compilemask":
        pre = (wl.mask.preprocessor(S, batch_size=1) if dev.type == "cuda"
               else functools.partial(wl.mask.preprocess, seqlen_q=S, batch_size=1))
        return lambda: {"compilemask_desc": pre(wl.rows())}
    if backend == "flex_fa4":
        cbm = _cbm() if dev.type == "cuda" else None
        if cbm is None:
            from torch.nn.attention.flex_attention import create_block_mask as cbm

        # one mask_mod over buffers refreshed per step: the compiled create_block_mask sees
        # the same function every step (a new closure per step could recompile it)
        bufs = {k: v.clone() for k, v in wl.rows().items()}
        mm = wl.mask_mod(bufs)

        def build():
            for k, v in wl.rows().items():
                bufs[k].copy_(v)
            return {FLEX_KW: cbm(mm, 1, None, S, S, device=dev)}
        return build
    if backend == "fa4_native":
        if wl.name not in ("causal", "docs"):
            return "n/a (FA4 has no native kernel for this mask)"
        if wl.name == "causal":
            return lambda: {FA4_KW: None}
        return lambda: {FA4_KW: wl.segments()}
    if backend == "sdpa":
        dense = wl.mask.preprocess(wl.rows(), seqlen_q=S, batch_size=1).dense_mask()[:, None]
        return lambda: {SDPA_KW: dense}
    raise ValueError(f"unknown backend {backend!r}")


# ---------------------------------------------------------------------------------------------
# model, steps, profile


def build_model(shape: dict, layers: int, impl: str, dtype, dev, seed: int):
    import transformers

    cfg = transformers.Qwen3Config(**shape, num_hidden_layers=layers, use_cache=False,
                                   attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = transformers.Qwen3ForCausalLM._from_config(cfg, attn_implementation=impl,
                                                           dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def token_ids(step: int, S: int, vocab: int, seed: int, dev):
    """The same ids for every backend: a CPU generator per step."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return torch.randint(0, vocab, (1, S), generator=g).to(dev)


class Timer:
    """Device time between marks: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def train_step(model, opt, ids, pos, build, timer):
    """One step: mask build, forward, backward, optimizer. -> (loss, step ms, mask ms)."""
    t0 = timer.mark()
    kw = build()
    t1 = timer.mark()
    loss = model(input_ids=ids, labels=ids, position_ids=pos, **kw).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t2 = timer.mark()
    timer.sync()
    return float(loss.detach()), timer.ms(t0, t2), timer.ms(t0, t1)


def _device_us(evt):
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, name):
            return getattr(evt, name)
    return 0.0


def attention_share(kernels) -> dict:
    """``kernels``: [(name, us)]. Attention (``ATTN_RULE``) over all kernel time, and the top
    kernels with their class, so the rule can be checked against the names."""
    rule = re.compile(ATTN_RULE, re.I)
    total = sum(t for _, t in kernels)
    attn = sum(t for n, t in kernels if rule.search(n))
    top = sorted(kernels, key=lambda x: -x[1])[:12]
    return {"share": attn / total if total else None, "attn_us": attn, "total_us": total,
            "top": [(n[:90], round(t, 1), bool(rule.search(n))) for n, t in top]}


def profile_steps(run, n: int = 2) -> dict:
    """Kernel times over ``n`` steps under torch.profiler (CUDA activity only)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
    kernels = [(e.key, _device_us(e)) for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA]
    if not kernels:  # builds that keep device events only in the flat list
        kernels = [(e.name, e.device_time) for e in prof.events()
                   if e.device_type == DeviceType.CUDA]
    out = attention_share(kernels)
    out["attn_ms_per_step"] = out["attn_us"] / 1e3 / n
    return out


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compile_model(model, scope: str):
    """``torch.compile`` of the whole model, or of each decoder layer (regional compilation:
    the layers are the same code, so one compile serves them all and compile time does not grow
    with depth); embeddings, head and loss stay eager in ``layers``."""
    if scope == "model":
        return torch.compile(model, dynamic=False)
    for layer in model.model.layers:
        layer.compile(dynamic=False)
    return model


def run_config(args, wl: Workload, backend: str, impl: str) -> dict:
    """Train one (mask, S, backend); failures go into the row's ``error``."""
    row = {"mask": wl.name, "S": wl.S, "backend": backend}
    build = step_builder(backend, wl) if wl.S <= args.sdpa_max or backend != "sdpa" else \
        f"skipped (S > {args.sdpa_max}; --backends sdpa --sdpa-max to run it)"
    if isinstance(build, str):
        row["error"] = build
        return row
    dev, timer = wl.dev, Timer(wl.dev)
    model = opt = fwd = None
    _free()
    torch._dynamo.reset()  # a fresh model per config: its own graphs, no recompile limit
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        model = build_model(args.shape, args.layers, impl, args.dtype, dev, args.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        _FLEX_STATE["compile_call"] = not args.compile and dev.type == "cuda"
        _FLEX_STATE["kernel_options"] = {"BACKEND": "FLASH"} if dev.type == "cuda" else None
        fwd = compile_model(model, args.compile_scope) if args.compile else model
        pos = wl.position_ids()
        vocab = args.shape["vocab_size"]
        losses, steps, masks = [], [], []
        n = args.warmup + args.steps
        for i in range(n):
            ids = token_ids(i, wl.S, vocab, args.seed, dev)
            loss, ms, mask_ms = train_step(fwd, opt, ids, pos, build, timer)
            losses.append(loss)
            if i >= args.warmup:
                steps.append(ms)
                masks.append(mask_ms)
            if i in (0, args.warmup - 1, n - 1):
                print(f"    {wl.name} S={wl.S} {backend} step {i}: loss {loss:.4f} "
                      f"{ms:.1f} ms", flush=True)
        row.update(step_ms=statistics.median(steps), step_mean_ms=statistics.fmean(steps),
                   tokens_s=wl.S / statistics.median(steps) * 1e3,
                   mask_ms=statistics.median(masks), losses=losses[:N_LOSSES])
        if dev.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            ids = token_ids(n, wl.S, vocab, args.seed, dev)
            prof = profile_steps(lambda: train_step(fwd, opt, ids, pos, build, timer))
            row.update(attn_share=prof["share"], attn_ms=prof["attn_ms_per_step"],
                       kernels_top=prof["top"])
            for name, us, is_attn in prof["top"]:  # the rule's verdicts, to check by eye
                print(f"      {'attn ' if is_attn else 'other'} {us / 2e3:9.3f} ms/step  {name}",
                      flush=True)
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = f"OOM: {str(e).splitlines()[0][:160]}"
    except Exception as e:  # a backend that fails is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        traceback.print_exc()
    finally:
        model = opt = fwd = None  # noqa: F841 (the compiled wrapper holds the model too)
        _free()
    return row


# ---------------------------------------------------------------------------------------------
# table


def _by_key(rows):
    return {(r["mask"], r["S"], r["backend"]): r for r in rows}


def loss_diffs(rows) -> list[str]:
    """Per row, the max abs loss difference to compilemask (and sdpa); WARNING lines for
    differences beyond ``REL_TOL`` of the loss."""
    keyed, warnings = _by_key(rows), []
    for r in rows:
        r["loss_diff"] = {}
        for ref in ("compilemask", "sdpa"):
            other = keyed.get((r["mask"], r["S"], ref))
            if ref == r["backend"] or not other or not other.get("losses") or not r.get("losses"):
                continue
            a, b = r["losses"], other["losses"]
            d = max(abs(x - y) for x, y in zip(a, b))
            r["loss_diff"][ref] = d
            if d > REL_TOL * max(abs(x) for x in b):
                warnings.append(f"WARNING: {r['mask']} S={r['S']} {r['backend']} losses differ "
                                f"from {ref} by {d:.4g} (> {REL_TOL:g} relative): {a} vs {b}")
    return warnings


def _speedup(keyed, r, peer):
    p = keyed.get((r["mask"], r["S"], peer))
    if not p or not p.get("step_ms") or not r.get("step_ms") or peer == r["backend"]:
        return ""
    return f"{p['step_ms'] / r['step_ms']:.2f}x"


def _num(x, fmt):
    return "" if x is None else format(x, fmt)


def to_markdown(rows, header_lines) -> str:
    keyed = _by_key(rows)
    warnings = loss_diffs(rows)
    out = list(header_lines) + [
        "", f"Attention share: CUDA time of kernels matching `{ATTN_RULE}` (case-insensitive) "
        "over all kernel time, torch.profiler over 2 steps. Speedups > 1: this backend is "
        "faster than the peer. Loss diff: max |loss - ref| over the first "
        f"{N_LOSSES} steps (ref: compilemask; sdpa where run).", "",
        "| mask | S | backend | step ms (mean) | tokens/s | peak GiB | attention % | "
        "mask/pre ms | vs flex_fa4 | vs fa4_native | max loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['mask']} | {r['S']} | {r['backend']} | {r['error'][:120]} "
                       "| | | | | | | |")
            continue
        diffs = "; ".join(f"{d:.2e} vs {k}" for k, d in r["loss_diff"].items())
        share = r.get("attn_share")
        out.append(
            f"| {r['mask']} | {r['S']} | {r['backend']} | {r['step_ms']:.1f} "
            f"({r['step_mean_ms']:.1f}) | {r['tokens_s']:.0f} | {_num(r.get('peak_gib'), '.1f')}"
            f" | {'' if share is None else f'{100 * share:.1f}'} | "
            f"{'prebuilt' if r['backend'] == 'sdpa' else _num(r.get('mask_ms'), '.3f')} | "
            f"{_speedup(keyed, r, 'flex_fa4')} | {_speedup(keyed, r, 'fa4_native')} | "
            f"{diffs} |")
    return "\n".join(out + [""] + warnings) + "\n"


def _version(mod):
    try:
        return __import__(mod).__version__
    except Exception:
        return "n/a"


def header(args, argv) -> list[str]:
    commit = os.environ.get("CM_COMMIT") or subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
        cwd=ROOT).stdout.strip() or "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    fa = "n/a"
    try:
        from importlib.metadata import version

        fa = version("flash-attn-4")
    except Exception:
        pass
    shape = ", ".join(f"{k}={v}" for k, v in args.shape.items())
    return [f"# End-to-end training: {datetime.date.today()} · {gpu} · commit {commit} · torch "
            f"{torch.__version__} · flash-attn-4 {fa} · transformers {_version('transformers')}",
            "", f"`{shlex.join(['python', 'bench/train_e2e.py', *argv])}`", "",
            f"Qwen3 {args.layers} layers ({shape}), {str(args.dtype).replace('torch.', '')}, "
            f"AdamW lr 1e-5 foreach, activation checkpointing, compile "
            f"{'on (' + args.compile_scope + ')' if args.compile else 'off'}, batch 1, "
            f"{args.warmup} warm-up + {args.steps} timed steps, seed {args.seed}"]


LABELS = {"compilemask": "compilemask", "flex_fa4": "Flex-FA4", "fa4_native": "FA4 native",
          "sdpa": "sdpa"}


def plot(rows, path: Path) -> Path | None:
    """Tokens/s per mask and backend, one panel per sequence length; each compilemask bar is
    labelled with its step-time ratio over the peer it is compared with (Flex-FA4, else FA4
    native). Needs matplotlib (the ``viz`` extra); without it the table is the result."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[viz]')", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error") and r.get("tokens_s")]
    seqlens = sorted({r["S"] for r in ok}, reverse=True)
    if not seqlens:
        return None
    keyed = _by_key(ok)
    fig, axes = plt.subplots(1, len(seqlens), figsize=(6.5 * len(seqlens), 3.8), squeeze=False)
    for ax, S in zip(axes[0], seqlens):
        names = [m for m in MASKS if any(r["mask"] == m and r["S"] == S for r in ok)]
        for i, m in enumerate(names):  # the bars of one mask centred on its tick
            here = [b for b in BACKENDS if (m, S, b) in keyed]
            width = 0.8 / max(len(here), 2)
            for k, b in enumerate(here):  # one color per backend in every panel
                r = keyed[(m, S, b)]
                x = i + (k - (len(here) - 1) / 2) * width
                ax.bar(x, r["tokens_s"] / 1e3, width, color=f"C{BACKENDS.index(b)}",
                       label=LABELS.get(b, b))
                ratio = "" if b != "compilemask" else (
                    _speedup(keyed, r, "flex_fa4") or _speedup(keyed, r, "fa4_native"))
                if ratio:
                    ax.annotate(ratio, (x, r["tokens_s"] / 1e3), ha="center", va="bottom",
                                fontsize=7)
        ax.set_xticks(range(len(names)), [m.replace("_", "\n") for m in names], fontsize=8)
        ax.set_ylabel("tokens/s (thousands)")
        ax.set_title(f"{S // 1024}K tokens" if S >= 1024 else f"{S} tokens")
        handles = dict(zip(*reversed(ax.get_legend_handles_labels())))  # one entry a backend
        top = max(r["tokens_s"] for r in ok if r["S"] == S) / 1e3
        ax.set_ylim(0, 1.22 * top)  # room above the bars for the legend
        ax.legend(handles.values(), handles.keys(), fontsize=7, loc="upper center",
                  ncol=len(handles))
    fig.suptitle("Training step, Qwen3 shape: tokens/s (label: compilemask's step-time ratio "
                 "over its peer)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(rows, head, out: Path, tag: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    md = to_markdown(rows, head)
    (out / f"train_e2e_{tag}.md").write_text(md)
    (out / f"train_e2e_{tag}.json").write_text(json.dumps({"header": head, "rows": rows},
                                                          indent=1))
    return md


def merge(paths, out: Path, tag: str) -> str:
    """One table from several runs: a later file's row replaces an earlier one of the same
    (mask, S, backend), except that a later error does not replace a measurement."""
    rows, heads = {}, []
    for p in map(Path, paths):
        data = json.loads(p.read_text())
        heads.append(f"- `{p.name}`: {data['header'][0].lstrip('# ')} {data['header'][2]}")
        for r in data["rows"]:
            key = (r["mask"], r["S"], r["backend"])
            if r.get("error") and key in rows and not rows[key].get("error"):
                continue
            rows[key] = r
    order = {m: i for i, m in enumerate(MASKS)}
    border = {b: i for i, b in enumerate(BACKENDS)}
    merged = sorted(rows.values(), key=lambda r: (order.get(r["mask"], 99), -r["S"],
                                                  border.get(r["backend"], 99)))
    md = write(merged, ["# End-to-end training, merged", "", *heads], out, tag)
    plot(merged, out / f"train_e2e_{tag}.png")
    print(md, flush=True)
    return md


# ---------------------------------------------------------------------------------------------
# command line


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--seqlens", default="32768,8192")
    ap.add_argument("--backends", default=None,
                    help=f"default {','.join(BACKENDS)} (sdpa only up to {SDPA_DEFAULT_MAX})")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the model (default: on with CUDA)")
    ap.add_argument("--compile-scope", choices=("layers", "model"), default="layers",
                    help="compile each decoder layer (default) or the whole model")
    ap.add_argument("--sdpa-max", type=int, default=None,
                    help="longest S for sdpa (default: any if --backends names it, else 8192)")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--tag", default=str(datetime.date.today()))
    ap.add_argument("--merge", nargs="+", metavar="JSON")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny Qwen3 on the CPU: compilemask vs sdpa, S=128, 3 steps")
    args = ap.parse_args(argv)
    args.shape, args.dtype = dict(SHAPE_8B), torch.bfloat16
    explicit = args.backends is not None
    if args.smoke:
        args.shape, args.layers, args.seqlens = dict(SHAPE_SMOKE), 2, "128"
        args.warmup, args.steps = 0, 3
        args.compile = bool(args.compile)  # off unless asked for
        args.backends = args.backends or "compilemask,sdpa"
    args.backends = (args.backends or ",".join(BACKENDS)).split(",")
    if args.sdpa_max is None:
        args.sdpa_max = 1 << 30 if explicit or args.smoke else SDPA_DEFAULT_MAX
    if args.compile is None:
        args.compile = torch.cuda.is_available()
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    out = Path(args.out)
    if args.merge:
        return merge(args.merge, out, args.tag)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    names = register_all()
    head, rows = header(args, argv), []
    for S in map(int, args.seqlens.split(",")):
        for name in args.masks.split(","):
            wl = Workload(name, S, dev, args.seed)
            for backend in args.backends:
                print(f"[{name} S={S} {backend}]", flush=True)
                row = run_config(args, wl, backend, names[backend])
                rows.append(row)
                print(f"  -> {row.get('error') or '%.1f ms/step' % row['step_ms']}", flush=True)
                md = write(rows, head, out, args.tag)
    plot(rows, out / f"train_e2e_{args.tag}.png")
    print(md, flush=True)
    bad = [ln for ln in md.splitlines() if ln.startswith("WARNING")]
    if args.smoke and bad:
        raise AssertionError("\n".join(bad))
    return rows


if __name__ == "__main__":
    main()
