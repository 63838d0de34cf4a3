"""Static SASS of FA4's sm90 forward on a partial-tile mask, compiled on the CPU (no GPU): the
interval test per score (``KernelOptions(mask_mod="intervals")``, or the rules) against the
Interval Table read a row at a time (``"rows"``, ``kernels/fa4_rowmask.py``).

Per variant: instructions, branches, integer compares (ISETP), selects (FSEL / SEL), R2P and
global loads of the forward kernel. A static count, not a timing (``bench/h200.sh engines``
with ``fa4_rows`` says what it is worth).

    python bench/sass_rowmask.py [--masks shared_prompt_rm,clear]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.sass import opcodes, variant_table  # noqa: E402

VARIANTS = ("intervals", "rules", "rows")


def _child(name: str, variant: str) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import compilemask as cm
    from compilemask import masks
    from compilemask.kernels import fa4

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import fake_on_cuda

    spec = masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    B, S, H, D = 2, 1000, 4, 128
    meta = masks.random_meta(spec, B, S, torch.Generator().manual_seed(0))
    desc = mask.preprocess(meta or None, seqlen_q=S, batch_size=B)
    lists = {"fwd": desc.block_sparse("fwd")}
    with FakeTensorMode():
        q = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
        fdesc, flists, _ = fake_on_cuda(desc, lists)
        fa4.fwd(q, q, q, fdesc, D**-0.5, "fa4", lists=flists["fwd"], variant=variant)


def _counts(dump: Path) -> dict:
    sass = next(dump.glob("*fwd_sm90*.sass")).read_text()
    return opcodes(sass, ["BRA", "ISETP", "FSEL", "SEL", "R2P", "LDG"])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--masks", default="shared_prompt_rm,clear,hstu")
    args = ap.parse_args()
    variant_table(__file__, args.masks.split(","), VARIANTS, _counts, "mask_mod")

if __name__ == "__main__":
    main()
