"""TorchTitan end to end: a Qwen3-8B-shaped TorchTitan model trained with each attention.

    python bench/torchtitan_e2e.py --out $OUT                       # every mask x method x length
    python bench/torchtitan_e2e.py --masks hstu,packed_hstu --methods compilemask,flex_fa4 \\
        --seqlens 32768 --steps 12 --layers 8 --out $OUT
    python bench/torchtitan_e2e.py --smoke --out /tmp/x              # tiny model, CPU, no GPU

What runs (one H100, 80 GB, a single rank). TorchTitan's (0.3.0 or 0.2.x, the differences in
``compilemask.integrations.torchtitan._compat``) Qwen3 at the 8B shape (hidden
4096, 32 heads, 8 kv heads, head dim 128, ffn 12288, vocab 151936) with ``--layers`` decoder
layers (default 8: at 32K tokens, with selective AC, that fits in 80 GB next to the fp32
embeddings, head and AdamW state; the run reports OOM where it does not), built on the meta
device and initialised from ``--seed`` (the same weights for every method), bf16 compute through
FSDP2 over the one rank (``fully_shard``, bf16 params / fp32 reduce), AdamW, TorchTitan's
selective activation checkpointing (CompileMask's policy for CompileMask: its attention output
is saved) and ``torch.compile`` per transformer block. One row of S tokens per step; the loss
is the cross entropy in chunks of 4096 tokens (the head applied per chunk, as TorchTitan's
chunked loss does).

Methods (the layer's inner attention is the only difference):

* ``compilemask``: ``CompileMaskAttention`` (engine auto), the descriptor from
  ``BatchDescriptors`` once per step;
* ``flex_fa4``: TorchTitan's ``FlexAttention`` with ``kernel_options={"BACKEND": "FLASH"}``
  and block size (256, 128) (its ``flex_flash`` backend), the BlockMask built per step as
  TorchTitan builds it (``create_attention_mask``);
* ``flex_triton``: TorchTitan's ``FlexAttention`` (Triton templates);
* ``fa4_native``: ``CompileMaskAttention(backend="native")``, FA4's own causal / varlen kernels
  (causal and documents only);
* ``compilemask_lists``: ``CompileMaskAttention(backend="fa4")``, the block-sparse lists and the
  interval mask_mod even where auto would run FA4's own kernel (a diagnostic);
* ``varlen``: TorchTitan's ``VarlenAttention`` (torch's varlen_attn; documents and causal).

Masks: ``hstu`` (one sequence per row: context, history to ~70 %, targets in groups of 64),
``shared_prompt_rm``, ``clear`` (radius 1, width 64), ``causal``, ``documents`` (lognormal
document lengths, causal within each), and ``packed_hstu``: the packed variable-length HSTU
workload (``compilemask.integrations.torchtitan.data.PackedSequences``: lognormal lengths,
mu = log(S / 8), sigma = 1.0, clipped to [64, S], targets the last 20 % in groups of 64).

Per (mask, S, method): median step time (CUDA events around whole steps after ``--warmup``;
descriptor or BlockMask build included; with ``--runs N``, the median of N groups' medians,
each reported), tokens/s, peak memory, every step's loss (agree with compilemask's to 1e-2
relative: same init, same data; ``--steps 16 --runs 3`` compares the first 51), and the
attention's share:
the forward + backward of one layer's inner attention alone on that step's q, k, v (same
method, same mask object), times the layers, over the step time. Each config runs in
try/except: an out-of-memory is reported as OOM, any other error by its message. With
``--peak-top N`` one more step runs under the allocator's history and the N largest
allocations live at its peak are reported with where each was made (what a higher peak is).
Each row is printed when its config ends and ``torchtitan_e2e.json`` in ``--out`` is rewritten
after every config (a stopped run keeps its rows); ``--budget-s`` skips the configs that start
with less time left than the method's last config took (its first, which compiles, counts as
the longest config so far). Ends with a markdown table and each mask against its bar.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after the installed packages: kernels/ would hide PyPI kernels

MASKS = ("hstu", "shared_prompt_rm", "clear", "causal", "documents", "packed_hstu")
METHODS = ("compilemask", "flex_fa4", "flex_triton", "fa4_native", "varlen")
# CompileMask with a fixed engine (diagnostics: the block-sparse lists where auto runs native)
CM_METHODS = {"compilemask": "auto", "fa4_native": "native", "compilemask_lists": "fa4"}
NATIVE_MASKS = ("causal", "documents")  # fa4_native and varlen run these only
REL_TOL = 1e-2
# what CompileMask's tokens/s must reach, over which peer's, per mask (the bars are set at 32K)
BARS = {"hstu": ("flex_fa4", 1.05), "shared_prompt_rm": ("flex_fa4", 1.05),
        "clear": ("flex_fa4", 1.05), "packed_hstu": ("flex_fa4", 1.2),
        "causal": ("fa4_native", 0.98), "documents": ("fa4_native", 0.98)}
CHUNK = 4096


# ---- data ---------------------------------------------------------------------------------------

def make_batch(mask: str, S: int, vocab: int, seed: int):
    """(input_dict, labels, compilemask mask name, mask_options) of one row of S tokens."""
    from compilemask.integrations.torchtitan.packed import PackedSequences

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, S + 1), generator=g)
    d = {"input": tokens[:, :-1], "positions": torch.arange(S).view(1, S)}
    labels = tokens[:, 1:]
    if mask in ("documents", "packed_hstu"):
        ds = PackedSequences(S, vocab_size=vocab, mu=math.log(max(S // 8, 2)), sigma=1.0,
                             min_len=min(64, S // 4), group_size=64 if S >= 1024 else 4,
                             seed=seed)
        row, labels, _ = ds._row()
        d = {k: v.unsqueeze(0) for k, v in row.items()}
        labels = labels.unsqueeze(0)
        if mask == "documents":
            d = {"input": d["input"], "positions": d["positions"]}
        return d, labels, ("block_causal" if mask == "documents" else "hstu"), {}
    if mask == "hstu":
        from compilemask.masks.hstu import bench_meta
        m = bench_meta(1, S, seed)
        if S < 1024:
            m["group_size"] = torch.full((1,), 4, dtype=torch.int32)
        d.update(m)  # one sequence per row: FLASH-translatable 1-D metadata
        return d, labels, "hstu_row", {}
    if mask == "shared_prompt_rm":
        from compilemask.masks.shared_prompt_rm import bench_meta
        d.update(bench_meta(1, S, seed))
        return d, labels, "shared_prompt_rm", {}
    if mask == "clear":
        from compilemask.masks.clear import bench_meta
        width = 64 if S >= 1024 else 8
        d.update(bench_meta(1, S, seed, width=width))
        return d, labels, "clear", {"radius": 1, "width": width}
    if mask == "causal":
        return d, labels, "causal", {}
    raise ValueError(f"unknown mask {mask!r}; one of {MASKS}")


# ---- models -------------------------------------------------------------------------------------

class DenseAttention(torch.nn.Module):
    """float64 dense masked softmax through autograd (the smoke mode's reference)."""

    def forward(self, q, k, v, *, attention_masks, scale=None, **kw):
        dense = attention_masks.desc.dense_mask()[:, None]
        q, k, v = (t.transpose(1, 2).double() for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
        p = torch.softmax(s.masked_fill(~dense, float("-inf")), -1).nan_to_num(0.0)
        return (p @ v).transpose(1, 2).to(torch.float32)


class RunConfig:
    """The model config, its inner attention's config and the Flex baseline's mask of one run
    (what the trainer's config holds; built without TorchTitan's trainer module, which imports
    datasets, metrics and checkpointing)."""

    def __init__(self, model_config, inner, flex_mask="", flex_mask_options=None):
        self.model_config, self.inner, self.flex_mask = model_config, inner, flex_mask
        self.flex_mask_options = dict(flex_mask_options or {})


BACKEND_OF = {"flex_fa4": "flex_flash", "flex_triton": "flex", "varlen": "varlen"}


def trainer_config(method: str, cm_mask: str, opts: dict, flavor: str, layers: int, S: int):
    from compilemask.integrations.torchtitan import _compat
    from compilemask.integrations.torchtitan.attention import CompileMaskAttention

    if method in (*CM_METHODS, "dense"):
        backend = CM_METHODS.get(method, "auto")
        inner = CompileMaskAttention.Config(mask=cm_mask, mask_options=dict(opts),
                                            backend=backend)
        return RunConfig(*_compat.qwen3_config(flavor, layers, S, "flex", inner))
    return RunConfig(*_compat.qwen3_config(flavor, layers, S, BACKEND_OF[method]), cm_mask,
                     opts)


def build_model(cfg, method, device, seed, compile_blocks, ac, fsdp, compile_scope="block"):
    """(model, output projection): the model returns the final norm's output.
    ``compile_scope``: ``block`` compiles each checkpointed block whole, the checkpoint inside
    the graph (TorchTitan's order); ``inner`` compiles the block inside an eager checkpoint."""
    from compilemask.integrations.torchtitan import _compat

    model = _compat.build_qwen3(cfg.model_config, device, seed)
    head = _compat.split_head(model)
    if method == "dense":
        for layer in model.layers.values():
            layer.attention.inner_attention = DenseAttention()
    if ac:
        _compat.apply_sac(model, save_compilemask=method in CM_METHODS,
                          compiled=compile_blocks)
    if compile_blocks:  # in place, as TorchTitan's apply_compile: the module stays FSDP-able
        for block in model.layers.values():
            inner = getattr(block, "_checkpoint_wrapped_module", None)
            (inner if compile_scope == "inner" and inner is not None else block).compile()
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mp_policy=mp)
        fully_shard(head, mp_policy=mp)  # called per loss chunk, outside the forward
        fully_shard(model, mp_policy=mp)
    return model, head


def batch_kwargs(method, cfg, d, labels):
    """What the trainer's hook gives the model: (inputs, labels, kwargs), timed by the caller."""
    from compilemask.integrations.torchtitan import _compat
    from compilemask.integrations.torchtitan.batch import BatchDescriptors, flex_block_mask
    from compilemask.integrations.torchtitan.masks import resolve_mask

    if method in (*CM_METHODS, "dense"):
        bd = batch_kwargs.cache.get(id(cfg))
        if bd is None:
            bd = batch_kwargs.cache[id(cfg)] = BatchDescriptors(cfg.inner)
        return bd(d, labels)
    if method == "varlen":
        return d["input"], labels, {"positions": d["positions"],
                                    "attention_masks": _compat.varlen_masks(d["positions"])}
    fields = {k: v for k, v in d.items() if k not in ("input", "positions")}
    bm = flex_block_mask(resolve_mask(cfg.flex_mask, cfg.flex_mask_options), d["positions"],
                         fields, cfg.inner)
    return d["input"], labels, {"positions": d["positions"], "attention_masks": bm}


batch_kwargs.cache = {}


def chunked_loss(head, h, labels):
    """Cross entropy with the head applied per chunk of tokens (no [S, vocab] logits kept);
    ``h`` is the model's output without its head (``split_head``: after the final norm)."""
    from torch.utils.checkpoint import checkpoint

    total = h.new_zeros((), dtype=torch.float32)
    n = (labels != -100).sum().clamp(min=1)
    hf, lf = h.flatten(0, 1), labels.flatten()
    for s in range(0, hf.shape[0], CHUNK):
        def part(x, y):
            logits = head(x).float()
            return torch.nn.functional.cross_entropy(logits, y, ignore_index=-100,
                                                     reduction="sum")
        total = total + checkpoint(part, hf[s:s + CHUNK], lf[s:s + CHUNK], use_reentrant=False)
    return total / n


def run_config(mask, S, method, args, device):
    from compilemask.integrations.torchtitan import _compat

    d, labels, cm_mask, opts = make_batch(mask, S, args.vocab, args.seed)
    if method in ("fa4_native", "varlen") and mask not in NATIVE_MASKS:
        return {"status": "n/a"}
    why = _compat.method_unavailable(BACKEND_OF[method]) if method in BACKEND_OF else None
    if why:
        return {"status": f"unavailable: {why}"}
    cfg = trainer_config(method, cm_mask, opts, args.flavor, args.layers, S)
    model, head = build_model(cfg, method, device, args.seed, not args.no_compile,
                              not args.no_ac, args.fsdp, args.compile_scope)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=device.type == "cuda")
    d = {k: v.to(device) for k, v in d.items()}
    labels = labels.to(device)
    times, losses, saved = [], [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.utils.counters.clear()

    def train_step():
        inputs, lab, kw = batch_kwargs(method, cfg, d, labels)
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda and not args.fsdp):
            m0 = torch.cuda.memory_allocated() if cuda else 0
            h = model(inputs, **kw)
            saved.append((torch.cuda.memory_allocated() - m0) / 2**30 if cuda else 0.0)
            loss = chunked_loss(head, h, lab)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return inputs, kw, loss

    for step in range(args.warmup + args.steps * args.runs):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        inputs, kw, loss = train_step()
        if cuda:
            e1.record()
            e1.synchronize()
            dt = e0.elapsed_time(e1) / 1e3
        else:
            dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if step >= args.warmup:
            times.append(dt)
    runs = [statistics.median(times[r * args.steps:(r + 1) * args.steps])
            for r in range(args.runs)]
    step_s = statistics.median(runs)
    row = {"status": "ok", "step_s": step_s, "run_step_s": runs, "tokens_per_s": S / step_s,
           "losses": losses,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
           # what the blocks' forward keeps for the backward (saved activations), and how the
           # blocks compiled: a graph break inside a checkpointed block changes both
           "fwd_kept_gib": statistics.median(saved)}
    c = torch._dynamo.utils.counters
    row["graph_breaks"] = sum(c["graph_break"].values())
    # whole: the hint and the user frame that say which write broke a checkpointed block
    row["break_reasons"] = list(c["graph_break"])[:3]
    row["graphs"] = c["stats"].get("unique_graphs", 0)
    row["attn_share"] = attention_share(model, inputs, kw, device, args) * args.layers / step_s
    if args.peak_top and cuda:
        row["peak_top"] = peak_step(train_step, args.peak_top)
    return row


def peak_step(train_step, top: int) -> dict:
    """One more step under the allocator's history: what is live when the step peaks. Python
    stacks first; where recording them fails inside the step (the backward's recomputation
    has raised a SystemError there), sizes alone, the row's timings kept either way."""
    failed = []
    for context in ("all", None):
        torch.cuda.memory._record_memory_history(
            context=context, stacks="python", max_entries=2_000_000)
        try:
            train_step()
            torch.cuda.synchronize()
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        except Exception as e:  # noqa: BLE001 - said in the row, then sizes alone
            failed.append(f"stacks: {type(e).__name__}: {e}"[:200])
            continue
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return {**peak_live(trace, top), **({"failed": failed} if failed else {})}
    return {"failed": failed}


def peak_live(trace, top: int) -> dict:
    """The allocations live when an allocator trace (``torch.cuda.memory._snapshot()``'s
    ``device_traces[d]``) peaks, the ``top`` largest with the innermost frame of this project
    or TorchTitan that made them (allocations made before the trace are not in it)."""
    live, total, peak, at = {}, 0, 0, -1
    for n, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > peak:
                peak, at = total, n
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])
    live = {}
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    largest = sorted(live.values(), key=lambda ev: -ev["size"])[:top]
    return {"peak_gib_over_trace_start": peak / 2**30, "live": len(live),
            "top": [{"mib": ev["size"] / 2**20, "where": _where(ev.get("frames", []))}
                    for ev in largest]}


def _where(frames) -> str:
    ours = ("compilemask", "torchtitan", "kernels", "bench", "flash_attn", "flex_attention")
    for f in frames:  # innermost first
        name = f.get("filename", "")
        if any(k in name for k in ours):
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return (f"{frames[0].get('filename', '?').rsplit('/', 1)[-1]}:{frames[0].get('line')} "
            f"{frames[0].get('name')}") if frames else "?"


def attention_share(model, inputs, kw, device, args):
    """Forward + backward of the first layer's inner attention alone (seconds), on q, k, v of
    that layer's shapes, with the step's mask object."""
    from compilemask.integrations.torchtitan import _compat

    block = model.layers["0"]
    attn = [m for n, m in block.named_modules() if n.endswith("inner_attention")][0]
    n_heads, n_kv_heads, head_dim = _compat.attention_dims(model)
    B, S = inputs.shape
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(B, S, n_heads, head_dim, device=device, dtype=dt, requires_grad=True)
    k, v = (torch.randn(B, S, n_kv_heads, head_dim, device=device, dtype=dt,
                        requires_grad=True) for _ in range(2))
    fn = lambda: attn(q, k, v, attention_masks=kw["attention_masks"],  # noqa: E731
                      enable_gqa=True).sum().backward()
    for _ in range(2):
        fn()
    reps = 3
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _is_oom(e):
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--masks", default=",".join(MASKS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seqlens", default="8192,32768")
    p.add_argument("--steps", type=int, default=8, help="timed steps (their losses compared)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=1,
                   help="groups of --steps timed steps, one after another on the same model: "
                        "each group's median is reported, the step time is their median")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--flavor", default="8B", help="TorchTitan Qwen3 flavor (8B: the 8B shape)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-scope", choices=("block", "inner"), default="block",
                   help="block: each checkpointed block compiled whole (TorchTitan's order); "
                        "inner: the block compiled inside an eager checkpoint")
    p.add_argument("--no-ac", action="store_true")
    p.add_argument("--peak-top", type=int, default=0,
                   help="after the timed steps, one step under the allocator's history: the N "
                        "largest allocations live at its peak, with where they were made")
    p.add_argument("--out", default=".")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="wall-clock seconds for all configs (0: no limit): a config whose "
                        "start leaves less than the method's last config took (the longest "
                        "config so far for a method not yet run) is skipped")
    p.add_argument("--smoke", action="store_true",
                   help="tiny debug model on the CPU: compilemask vs a dense float64 reference")
    args = p.parse_args(argv)
    args.fsdp = False
    if args.smoke:
        device = torch.device("cpu")
        args.flavor, args.layers, args.vocab = "debugmodel", 1, 2048
        args.steps, args.warmup, args.no_compile = 2, 0, True
        masks, methods, seqlens = ["packed_hstu"], ["compilemask", "dense"], [128]
    else:
        device = torch.device("cuda")
        try:  # TorchTitan's model code on this torch: say so once, not per config
            import torchtitan.models.qwen3  # noqa: F401
        except Exception as e:
            raise SystemExit(f"torchtitan does not import on torch {torch.__version__}: "
                             f"{type(e).__name__}: {e}") from e
        masks, methods = args.masks.split(","), args.methods.split(",")
        seqlens = [int(s) for s in args.seqlens.split(",")]
        args.fsdp = _init_single_rank()
    from compilemask.integrations.torchtitan import _compat

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"args": vars(args), "device": torch.cuda.get_device_name()
            if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "torchtitan": _titan_version(), "torchtitan_layout": "0.2" if _compat.legacy()
            else "0.3", "rows": []}
    print(f"torch {meta['torch']}, torchtitan {meta['torchtitan']}, {meta['device']}",
          flush=True)
    rows = meta["rows"]
    # a method's later configs reuse its compiled kernels: its last config is the estimate
    t_start, longest, last = time.monotonic(), 0.0, {}
    for S in seqlens:
        for mask in masks:
            base = None
            for method in methods:
                row = {"mask": mask, "seqlen": S, "method": method, "layers": args.layers}
                t0 = time.monotonic()
                left = args.budget_s - (t0 - t_start)
                if args.budget_s > 0 and left < last.get(method, longest):
                    row["status"] = f"skipped: {left:.0f} s of --budget-s left"
                else:
                    try:
                        row.update(run_config(mask, S, method, args, device))
                    except Exception as e:  # one config's failure is reported, the rest run
                        row.update(status="OOM" if _is_oom(e) else f"error: "
                                   f"{type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:200] if str(e) else ''}")
                        if not _is_oom(e):
                            traceback.print_exc()
                    finally:
                        batch_kwargs.cache.clear()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    row["wall_s"] = time.monotonic() - t0
                    longest = max(longest, row["wall_s"])
                    if row["status"] == "ok":  # not "n/a": those take no time
                        last[method] = row["wall_s"]
                if row["status"] == "ok":
                    if method == "compilemask" or base is None and method in CM_METHODS:
                        base = row
                    row["loss_agrees"] = base is not None and all(
                        abs(a - b) <= REL_TOL * abs(b) for a, b in zip(row["losses"],
                                                                       base["losses"]))
                rows.append(row)
                print(_fmt(row), flush=True)
                # rewritten after every config: a run stopped midway keeps its rows
                (out / "torchtitan_e2e.json").write_text(json.dumps(meta, indent=1))
    print(table(rows), flush=True)
    meta["bars"] = against_bars(rows)
    (out / "torchtitan_e2e.json").write_text(json.dumps(meta, indent=1))
    print(bars_table(meta["bars"]), flush=True)
    return rows


def _titan_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "unknown"


def _init_single_rank() -> bool:
    """FSDP over one rank: a one-process NCCL group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    return True


def _fmt(r):
    if r["status"] != "ok":
        return f"{r['mask']:>16} {r['seqlen']:>6} {r['method']:>12}: {r['status']}"
    reasons = [x[:160] for x in r["break_reasons"]]  # whole in the JSON
    peak = "".join(f"\n    {a['mib']:9.1f} MiB  {a['where']}" for a in r.get("peak_top", {})
                   .get("top", []))
    peak += "".join(f"\n    peak trace: {f}" for f in r.get("peak_top", {}).get("failed", []))
    return (f"{r['mask']:>16} {r['seqlen']:>6} {r['method']:>12}: {r['step_s'] * 1e3:8.1f} ms "
            f"{r['tokens_per_s']:9.0f} tok/s attn {100 * r['attn_share']:5.1f} % "
            f"loss0 {r['losses'][0]:.4f} peak {r['peak_gib']:.1f} kept {r['fwd_kept_gib']:.1f} GiB "
            f"graphs {r['graphs']} breaks {r['graph_breaks']} {reasons}{peak}")


def table(rows):
    lines = ["| mask | S | method | step (ms) | tokens/s | attention share | peak GiB | "
             "losses agree |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['mask']} | {r['seqlen']} | {r['method']} | {r['status']} |"
                         " | | | |")
            continue
        lines.append(f"| {r['mask']} | {r['seqlen']} | {r['method']} | {r['step_s'] * 1e3:.1f} "
                     f"| {r['tokens_per_s']:.0f} | {100 * r['attn_share']:.1f} % | "
                     f"{r['peak_gib']:.1f} | {'yes' if r.get('loss_agrees') else 'NO'} |")
    return "\n".join(lines)


def against_bars(rows):
    """Per (mask, S) with a bar: CompileMask's step against its peer's in the same run, and what
    bounds it. Attention's time is its share times the step, the rest is the step without it;
    ``ceiling`` is the ratio with CompileMask's attention free, ``needed`` the attention speedup
    over the peer's that would meet the bar with CompileMask's rest (None: the rest alone
    misses it)."""
    ok = {(r["mask"], r["seqlen"], r["method"]): r for r in rows if r["status"] == "ok"}
    out = []
    for (mask, S, method), cm in ok.items():
        if method != "compilemask" or mask not in BARS:
            continue
        peer_name, bar = BARS[mask]
        peer = ok.get((mask, S, peer_name))
        if peer is None:
            continue
        attn, rest = _split(cm)
        p_attn, p_rest = _split(peer)
        room = peer["step_s"] / bar - rest
        out.append({"mask": mask, "seqlen": S, "peer": peer_name, "bar": bar,
                    "ratio": peer["step_s"] / cm["step_s"], "attn_ratio": p_attn / attn,
                    "attn_ms": attn * 1e3, "peer_attn_ms": p_attn * 1e3,
                    "rest_ms": rest * 1e3, "peer_rest_ms": p_rest * 1e3,
                    "attn_share": cm["attn_share"], "ceiling": peer["step_s"] / rest,
                    "needed": p_attn / room if room > 0 else None})
    return out


def _split(row):
    attn = row["attn_share"] * row["step_s"]
    return attn, row["step_s"] - attn


def bars_table(bars):
    lines = ["| mask | S | vs | bar | step ratio | attention ratio | attention share | "
             "attention ms (peer) | rest ms (peer) | attention free | attention ratio needed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in bars:
        need = ("unreachable: the rest alone" if b["needed"] is None
                else f"{b['needed']:.2f}x")
        lines.append(
            f"| {b['mask']} | {b['seqlen']} | {b['peer']} | {b['bar']:.2f}x | "
            f"{b['ratio']:.3f}x | {b['attn_ratio']:.2f}x | {100 * b['attn_share']:.1f} % | "
            f"{b['attn_ms']:.0f} ({b['peer_attn_ms']:.0f}) | "
            f"{b['rest_ms']:.0f} ({b['peer_rest_ms']:.0f}) | {b['ceiling']:.2f}x | {need} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
