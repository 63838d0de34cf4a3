"""Static SASS of FA4's sm90 kernels with a score_mod, compiled on the CPU (no GPU), D = 128,
bf16, the native engine:

* ``softcap``: sliding window 4096 with a softcap of 50 as FA4's own ``softcap`` against the
  generated score_mod (``KernelOptions(softcap=...)``);
* ``alibi``: causal with ALiBi, ``kv_idx - q_idx`` converted by I2F against by bits
  (``KernelOptions(score_index=...)``), and causal without a score_mod;
* ``temperature``: causal with a per-head temperature ``score / temps[h]`` (a divisor the same
  for the whole tile: one reciprocal, then a multiply per score);
* ``unwrap``: causal with ALiBi on the native and the fa4 engine, FA4's index wrap
  (``kernels/fa4_unwrap.py`` off) against none, and causal without a score_mod;
* ``spills``: registers and spill bytes (``ptxas -v``) of the benchmarked mask + score_mod
  pairs on their engines, forward and backward;
* ``t5``: the same for prefix-LM + T5, its index by bits or I2F, with and without FA4's wrap,
  and with the per-score rules in the forward (``KernelOptions(mask_mod="rules")``) for the
  row mask the default picks;
* ``tables``: causal + T5 on the fa4 engine (the table bench's pair), the backward with the
  table frozen and trained (``score_mod_bwd`` adding its gradient,
  ``docs/decisions/trainable-score-tables.md``): registers, spills and the backward's opcodes.

Per kernel: instructions, branches, MUFU.TANH / MUFU.EX2, I2FP (sm90's int-to-float), FFMA /
FMUL, and the PTX's ``div.rn.f32`` (an IEEE division per score, which ptxas expands into a
reciprocal, Newton steps and a slow-path branch). A static count, not a timing: it says what
each score costs, the H200 says what that is worth (``bench/h200.sh engines``).

    python bench/sass_score_mod.py softcap
    python bench/sass_score_mod.py alibi
    python bench/sass_score_mod.py temperature
    python bench/sass_score_mod.py unwrap
    python bench/sass_score_mod.py spills
    python bench/sass_score_mod.py t5
    python bench/sass_score_mod.py tables
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
from bench.sass import compile_in_child, fake_fa4, opcodes, print_table, registers  # noqa: E402

KINDS = {"softcap": ("fa4", "score_mod"), "alibi": ("none", "cvt", "bits"),
         "temperature": ("temperature",),
         "unwrap": ("none", "bits-wrapped", "bits", "causal/alibi/fa4-wrapped",
                    "causal/alibi/fa4"),
         "spills": ("causal/alibi/native", "causal/alibi/fa4", "prefix_lm/t5/fa4",
                    "sliding_window/softcap/native", "hstu/temperature/fa4"),
         "t5": ("prefix_lm/t5/fa4", "prefix_lm/t5/fa4/cvt", "prefix_lm/t5/fa4-wrapped",
                "prefix_lm/t5/fa4/cvt-wrapped", "prefix_lm/t5/fa4/rules"),
         "tables": ("frozen", "trained")}


def _spills_child(item: str) -> None:
    # one mask + score_mod on one engine, with the options' defaults (bench/engines.py's)
    import torch

    import compilemask as cm
    from bench.engines import SPECS, make_score_mod
    from compilemask import masks
    from compilemask.dsl.score_mod import compile_score_mod
    from compilemask.kernels.autograd import _score_variant

    # further parts: "cvt" (the index by I2F, not bits), a mask_mod variant ("rules", "rows")
    name, smod, engine, *rest = item.split("/")
    variant = next((p for p in rest if p in ("rules", "rows", "intervals")), None)
    spec = SPECS[name]()
    B, S, H, D = 2, 1000, 8, 128
    meta = masks.random_meta(spec, B, S, torch.Generator().manual_seed(0))
    sm, tables = compile_score_mod(make_score_mod(smod, "cpu"))
    fake_fa4(cm.compile_mask(spec), meta, B=B, S=S, H=H, D=D, engine=engine,
             variant=variant, score=_score_variant(sm.key, True, "cvt" not in rest),
             tables=tables)


def _tables_child(kind: str) -> None:
    # causal + T5 on the fa4 engine as bench/score_tables.py runs it, the backward with the
    # table's gradient buffer where trained
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import compilemask as cm
    from compilemask import masks
    from compilemask.dsl import score_mods
    from compilemask.dsl.score_mod import compile_score_mod
    from compilemask.kernels import fa4

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import fake_on_cuda

    B, S, H, D = 2, 1000, 8, 128
    sm, tables = compile_score_mod(score_mods.t5_bias(torch.randn(32, H), 128))
    desc = cm.compile_mask(masks.causal()).preprocess(None, seqlen_q=S, batch_size=B)
    lists = {k: desc.block_sparse(k) for k in ("fwd", "bwd64")}
    with FakeTensorMode():
        q = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
        fdesc, fl, fake = fake_on_cuda(desc, lists)
        sc = (sm, [fake(t) for t in tables])
        out, lse = fa4.fwd(q, q, q, fdesc, D**-0.5, "fa4", lists=fl["fwd"], score=sc)
        grads = {0: fake(torch.zeros(tables[0].shape))} if kind == "trained" else None
        fa4.bwd(q, q, q, q, out, lse, fdesc, D**-0.5, "fa4", lists=fl["bwd64"], score=sc,
                table_grads=grads)


def _child(kind: str) -> None:
    if kind in KINDS["tables"]:
        _tables_child(kind)
        return
    if kind.endswith("-wrapped"):  # FA4's calls as they are: every index wrapped
        from compilemask.kernels import fa4_unwrap

        kind = kind.removesuffix("-wrapped")
        fa4_unwrap._unwrapped = lambda fn: False
    if kind in KINDS["spills"] + KINDS["t5"]:
        _spills_child(kind)
        return
    import dataclasses

    import torch

    import compilemask as cm
    from compilemask import masks
    from compilemask.dsl import score_mods
    from compilemask.dsl.score_mod import compile_score_mod

    def softcap(score, b, h, q_idx, kv_idx):
        return 50.0 * torch.tanh(score / 50.0)

    B, S, H, D = 2, 300, 4, 128
    if kind in KINDS["softcap"]:
        mask, fn = cm.compile_mask(masks.sliding_window(4096)), softcap
    elif kind == "temperature":
        mask = cm.compile_mask(masks.causal())
        fn = score_mods.temperature(torch.linspace(0.5, 1.5, H))
    else:
        mask, fn = cm.compile_mask(masks.causal()), score_mods.alibi(score_mods.alibi_slopes(H))
    sm, tables = compile_score_mod(fn)
    if kind == "score_mod":  # what KernelOptions(softcap="score_mod") hands FA4
        sm = dataclasses.replace(sm, softcap=None, key="")
    if kind == "bits":  # what KernelOptions(score_index="bits") hands FA4
        sm = dataclasses.replace(sm, index_bits=True, key="")
    fake_fa4(mask, None, B=B, S=S, H=H, D=D, engine="native",
             score=None if kind == "none" else sm, tables=tables)


def _counts(dump: Path, kernel: str) -> dict:
    sass = next(dump.glob(f"*{kernel}*.sass")).read_text()
    ptx = next(dump.glob(f"*{kernel}*.ptx")).read_text()
    return {**opcodes(sass, ["BRA", "MUFU.TANH", "MUFU.EX2", "I2FP", "FFMA", "FMUL"]),
            "div.rn.f32 (PTX)": ptx.count("div.rn.f32")}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
        return
    which = sys.argv[1] if len(sys.argv) > 1 else "softcap"
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for kind in KINDS[which]:
            dump = Path(tmp) / kind.replace("/", "_")
            dump.mkdir()
            if not compile_in_child(__file__, [kind], dump):
                sys.exit(1)
            for kernel in ("fwd_sm90", "bwd_sm90"):
                if which in ("spills", "t5"):
                    rows[(kind, kernel)] = registers(next(dump.glob(f"*{kernel}*.ptx")))
                elif which == "tables":
                    rows[(kind, kernel)] = {
                        **registers(next(dump.glob(f"*{kernel}*.ptx"))),
                        **opcodes(next(dump.glob(f"*{kernel}*.sass")).read_text(),
                                  ["SHFL", "VOTE", "MATCH", "RED", "ATOM", "STL", "LDL"])}
                else:
                    rows[(kind, kernel)] = _counts(dump, kernel)
    label = {"softcap": "softcap as", "spills": "mask / score_mod / engine",
             "t5": "mask / score_mod / engine", "tables": "causal + T5, table"}
    print_table([label.get(which, "score_mod"), "kernel"], rows)


if __name__ == "__main__":
    main()
