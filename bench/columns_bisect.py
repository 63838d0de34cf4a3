"""Where FA4's backward masked by the column view goes wrong (CUDA refuses the view meanwhile,
``pipeline.COLUMN_VIEW_ON_CUDA``): one process per mode, the gate opened inside, head dim 128,
2 x 1000 rows, GQA 4/2.

* ``table``: each mask's column table written on the GPU against the torch reference, key by
  key; then, for the ``--grads`` masks, out / dq / dk / dv against the float32 reference with
  the GPU's table, with the reference's table, and with the default per-score test, and the
  rows of dq and the keys of dk that are off;
* ``fa4_path``: the view's mask_mod through FA4's own per-score code (the class takes no call);
* ``rows``: every key through the class's Interval Table branch (its per-row test), not the runs.

If the tables differ, the generated program is at fault; if ``fa4_path`` passes and the others
fail, the class's masking is; if ``rows`` passes too, the runs test is.

    python bench/columns_bisect.py table --masks causal,shared_prompt_rm --grads causal
    python bench/columns_bisect.py fa4_path
    python bench/columns_bisect.py rows
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import compilemask as cm  # noqa: E402
from compilemask import masks, pipeline  # noqa: E402
from compilemask.columns import column_table  # noqa: E402
from compilemask.reference import attention_reference  # noqa: E402

B, S, H, HKV, D = 2, 1000, 4, 2, 128


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _grads(desc, q, k, v, do, options=None):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = cm.attention(qq, kk, vv, desc, backend="fa4", options=options)
    o.backward(do)
    return o, qq.grad, kk.grad, vv.grad


def _install(mode: str) -> None:
    from compilemask.kernels import fa4_colmask

    if mode == "fa4_path":
        fa4_colmask.ColumnIntervalMask.takes = lambda self, mask_mod, causal, local: False
    elif mode == "rows":
        fa4_colmask.ColumnIntervalMask.ROWS_ONLY = True


def run(mode: str, names: list[str], grads: list[str]) -> None:
    pipeline.COLUMN_VIEW_ON_CUDA = True
    _install(mode)
    print(f"mode {mode}", flush=True)
    for name in names:
        mask = cm.compile_mask(masks.EXAMPLES[name]())
        meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(13))
        meta = {key: t.cuda() for key, t in meta.items()}
        desc = mask.preprocess(meta or None, S, batch_size=B, device="cuda",
                               config=pipeline.PipelineConfig(column_view=True))
        ref = column_table(mask, desc.params.cpu(), desc.row_params.cpu(), S)
        bad = (desc.columns.cpu() != ref).flatten(2).any(-1)
        print(f"{name}: table keys that differ {int(bad.sum())} of {bad.numel()} (table on "
              f"{desc.columns.device}, params on {desc.params.device})", flush=True)
        for b, j in bad.nonzero()[:3].tolist():
            print(f"  key {b},{j}: gpu {desc.columns[b, j].tolist()} ref {ref[b, j].tolist()}")
        if name not in grads:
            continue
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        do = torch.randn_like(q)
        qq, kk, vv = (t.detach().float().requires_grad_() for t in (q, k, v))
        o = attention_reference(qq, kk, vv, desc.dense_mask())
        o.backward(do.float())
        exact = (o, qq.grad, kk.grad, vv.grad)
        cases = [("gpu table", desc, None)]
        if mode == "table":
            cases += [("reference table",
                       dataclasses.replace(desc, columns=ref.cuda().contiguous()), None),
                      ("per-score default", desc, cm.KernelOptions(mask_mod="intervals"))]
        for what, d, opts in cases:
            got = _grads(d, q, k, v, do, opts)
            errs = " ".join(f"{n} {_rel(a, e):.4f}"
                            for n, a, e in zip(("out", "dq", "dk", "dv"), got, exact))
            print(f"  {what:18s} {errs}", flush=True)
            if what == "gpu table":
                for n, a, e in (("dq rows", got[1], exact[1]), ("dk keys", got[2], exact[2])):
                    err = ((a.float() - e).norm(dim=(-1, -2))
                           / e.norm(dim=(-1, -2)).clamp_min(1e-6))
                    off = (err > 0.05).nonzero().tolist()
                    print(f"    {n} off: {len(off)}, first {off[:8]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["table", "fa4_path", "rows"])
    ap.add_argument("--masks", default="causal")
    ap.add_argument("--grads", default="causal")
    args = ap.parse_args()
    run(args.mode, args.masks.split(","), args.grads.split(","))


if __name__ == "__main__":
    main()
